"""Submit the Tinker-API service to a Ray cluster as a long-lived Ray job, as `cluster.submit` submits a run.

`python -m cluster.serve.submit --address http://HEAD:8265 SERVE_CONFIG` checks the service's config here
first (a bad one exits 2 naming the field, before anything is contacted), uploads the repo (or
`--working-dir`) as the job's working dir with `cluster.submit`'s excludes, starts
`python -m cluster.serve CONFIG --ray-address auto` on the cluster (the service joins the job's cluster,
never starts one: `cluster.serve.ray_address`) and streams its log, `serving <url>` among its first
lines, until the job ends. `ray job stop` ends it (its tenants' actors end with the job; exit 1:
stopped); Ctrl-C stops following, not the service. Exit codes, token auth and the SSH tunnel as
`cluster.submit`'s.

The submission id is `serve-<6 hex>`; the job's metadata, for the Jobs view and `ray job list`:
`rayppo_service` (that id), `rayppo_config` (the config's path in the working dir) and
`rayppo_base_models` (the names served).

The service listens on the node its job's driver runs on (the head) at the config's `host` and `port`.
Relative paths in the config resolve in the job's temporary copy of the working dir, which leaves out
`assets/` and `runs/`: a warning names each (give paths on the cluster's storage).
"""

from __future__ import annotations

import argparse
import secrets
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from cluster.serve.config import ServeConfig, load_serve_config
from cluster.serve.ray_address import AUTO, ray_address
from cluster.submit import (
    EXIT_BAD_INPUT,
    REPO_ROOT,
    add_cluster_arguments,
    checked_working_dir,
    config_path_on_cluster,
    normalize_address,
    submit,
    submit_and_follow,
)

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient


def load_checked(config: str | Path) -> ServeConfig:
    """The service's config as the job will load it, and joining the job's cluster (ValueError or
    OSError naming what is wrong)."""
    cfg = load_serve_config(config)
    ray_address(cfg.ray_address, AUTO, in_job=True)
    return cfg


def build_entrypoint(config: str) -> str:
    """The shell command the job runs: the service on the job's own cluster; every argument quoted."""
    return shlex.join(["python", "-m", "cluster.serve", config, "--ray-address", AUTO])


def relative_path_warnings(cfg: ServeConfig, working_dir: str | Path | None) -> list[str]:
    """One warning per relative path of the config when a working dir is uploaded."""
    if working_dir is None:
        return []
    named = {f"base_models[{i}].path": e.path for i, e in enumerate(cfg.base_models)}
    named["checkpoint_dir"] = cfg.checkpoint_dir
    return [
        f"warning: {field}={path!r} is relative, so it resolves inside the job's temporary copy of the "
        "working dir on the cluster (assets/ and runs/ are not uploaded): give a path on the cluster's storage"
        for field, path in named.items()
        if path is not None and not Path(path).is_absolute()
    ]


def submit_service(
    address: str,
    config: str,
    *,
    working_dir: str | Path | None = REPO_ROOT,
    timeout_s: float = 10.0,
    client: JobSubmissionClient | None = None,
) -> str:
    """Validate the config here (ValueError/OSError before any contact), then submit `cluster.serve`
    under a submission id of its own, with the service's metadata; returns the id."""
    cfg = load_checked(config)
    config_on_cluster = config_path_on_cluster(config, working_dir)
    job_id = f"serve-{secrets.token_hex(3)}"
    metadata = {
        "rayppo_service": job_id,
        "rayppo_config": config_on_cluster,
        "rayppo_base_models": ",".join(e.name for e in cfg.base_models),
    }
    return submit(
        address,
        build_entrypoint(config_on_cluster),
        working_dir=working_dir,
        metadata=metadata,
        submission_id=job_id,
        timeout_s=timeout_s,
        client=client,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cluster.serve.submit",
        description="Submit the Tinker-API service (python -m cluster.serve) to a Ray cluster as a job.",
    )
    ap.add_argument("config", help="the service's YAML (cluster/serve/config.py), inside the working dir")
    add_cluster_arguments(ap)
    args = ap.parse_args(argv)
    try:
        working_dir = checked_working_dir(args)
        address = normalize_address(args.address)
        cfg = load_checked(args.config)
        config_path_on_cluster(args.config, working_dir)
    except (OSError, ValueError, yaml.YAMLError) as err:
        print(f"error: {args.config}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for warning in relative_path_warnings(cfg, working_dir):
        print(warning, file=sys.stderr)

    def start(client: JobSubmissionClient) -> str:
        return submit_service(address, args.config, working_dir=working_dir, client=client)

    return submit_and_follow(address, start, connect_timeout_s=args.connect_timeout, wait=not args.no_wait)


if __name__ == "__main__":
    sys.exit(main())
