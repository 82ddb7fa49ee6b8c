"""One run folder for every node: paths made absolute at start-up, then checked from the learner ranks.

The driver writes metrics, run state and checkpoint markers; each learner rank writes its DeepSpeed
shards and rank 0 writes `final/`. On several nodes that only works when the run folder (and the
model folders the ranks read) is the same shared path everywhere, so at start-up every rank writes
a probe file into the run folder and the driver reads it back: a rank that cannot write it, or
whose file the driver cannot see, stops the run with an error that names the option to fix.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import ray

from cluster.config.data_section import CHAT_TEMPLATE_KEYWORDS
from cluster.config.schema import RunConfig
from cluster.roles.registry import ROLES

PATH_FIELDS = (  # attribute paths from the run config
    ("run", "output_dir"),
    ("model", "policy_path"),
    ("model", "tokenizer_path"),
    ("model", "demo_assets", "folder"),
    ("data", "prompts_path"),  # a path, a glob or a list of them: each made absolute
    ("data", "chat_template"),
    ("eval", "prompts_path"),
    *(path for role in ROLES for path in role.path_attributes()),  # the roles' own model folders
)
KEYWORDS = {("data", "chat_template"): CHAT_TEMPLATE_KEYWORDS}  # a path field's values that are no path


class SharedStorageError(RuntimeError):
    """A learner rank does not see the run folder (or a model folder) at the driver's path."""


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """Every path field made absolute against the driver's working directory (in place; returned),
    so actors whose working directory differs (other nodes, job copies) mean the same file."""
    for *parents, field in PATH_FIELDS:
        keywords = KEYWORDS.get((*parents, field), ())
        part = cfg
        for name in parents:
            part = getattr(part, name, None) if part is not None else None
        value = getattr(part, field) if part is not None else None
        if isinstance(value, list):
            setattr(part, field, [_absolute(v) for v in value])
        elif value and value not in keywords:
            setattr(part, field, _absolute(value))
    return cfg


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def rank_paths(cfg: RunConfig) -> list[tuple[str, str]]:
    """(option, path) of the folders a learner rank reads: the policy, and the tokenizer it copies into final/."""
    paths = [("model.policy_path", cfg.model.policy_path)]
    if cfg.model.tokenizer_path:
        paths.append(("model.tokenizer_path", cfg.model.tokenizer_path))
    return paths


def probe_name(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f".probe-rank-{rank}-{os.getpid()}"


def _probe(_actor: Any, probe: str, rank: int, paths: list[tuple[str, str]]) -> dict:
    """Runs inside a learner rank's process: write the probe file, look for the folders it reads."""
    host = socket.gethostname()
    out: dict[str, Any] = {"host": host, "write_error": None}
    out["missing"] = [f"{option}={path}" for option, path in paths if not Path(path).exists()]
    try:
        Path(probe).write_text(f"rank {rank} on {host}\n")
    except OSError as err:
        out["write_error"] = f"{type(err).__name__}: {err}"
    return out


def check_ranks_see_run_folder(cfg: RunConfig, run_dir: Path, ranks: list[Any], timeout: float) -> None:
    """Every learner rank writes a probe into `run_dir`; the driver must read each one back."""
    probes = [probe_name(run_dir, i) for i in range(len(ranks))]
    paths = rank_paths(cfg)
    refs = [
        r.__ray_call__.remote(_probe, str(p), i, paths)
        for i, (r, p) in enumerate(zip(ranks, probes, strict=True))
    ]
    results = ray.get(refs, timeout=timeout)
    here = socket.gethostname()
    hint = "a multi-node run needs shared storage mounted at the same path on every node"
    try:
        for i, (res, probe) in enumerate(zip(results, probes, strict=True)):
            where = f"learner rank {i} (host {res['host']})"
            if res["missing"]:
                raise SharedStorageError(
                    f"{where} does not see {', '.join(res['missing'])} that the driver (host {here}) "
                    f"sees: {hint}, or the same files at the same path"
                )
            if res["write_error"] or not probe.is_file():
                why = res["write_error"] or f"its probe file is not visible to the driver (host {here})"
                raise SharedStorageError(
                    f"run.output_dir / --run-dir: {where} cannot share the run folder {run_dir}: {why}; {hint}"
                )
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)
