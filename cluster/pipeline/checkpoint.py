"""Atomic, pruned run checkpoints: the learner's DeepSpeed state plus the trainer's run state.

A checkpoint is written into a hidden `.step-N.partial` folder and renamed to `step-N` only
after every part is on disk and a COMPLETE marker (holding the state file's sha256) is written,
so a crash mid-write never leaves a folder that looks complete. Durable against a machine crash,
not only a process crash: every file and folder of the checkpoint is fsynced before the rename,
and the parent folder after it. Rewriting an existing `step-N` moves the old one aside to
`.step-N.old` first and deletes it only after the new one is in place; a crash in between leaves
the old one, which `list_checkpoints` puts back. Resuming from a folder that is empty or corrupt is
an error, never a silent fresh start.

When one is written (`Cadence`: every N steps and/or M minutes) and which are kept (`to_prune`: the
newest K plus the best K by a step metric) are pure logic here, tested without Ray.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from cluster.records.ray_waits import wait_until
from cluster.roles.registry import LEARNER

FORMAT = 1
STATE_FILE = "state.json"
LEARNER_DIR = LEARNER.name  # the learner ranks' DeepSpeed state: the checkpoint's folder named for its role
COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for; the message names the folder."""


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Cadence:
    """When a checkpoint is due at the end of a step: every `every_steps` steps, and/or once
    `every_minutes` have passed since the last checkpoint (or the start). `clock` is injectable."""

    def __init__(
        self, every_steps: int, every_minutes: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_steps, self.every_s, self.clock = every_steps, every_minutes * 60.0, clock
        self.last = clock()

    def due(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        return self.every_s > 0 and self.clock() - self.last >= self.every_s

    def written(self) -> None:
        """A checkpoint was just written (by the cadence or otherwise): the minutes count from now."""
        self.last = self.clock()


def to_prune(scores: dict[int, float | None], keep_last: int, keep_best: int, mode: str) -> list[int]:
    """Steps (of `scores`: step -> best_metric value) whose checkpoints are deleted: all but the
    newest `keep_last` and the `keep_best` with the best value (`mode` 'max' or 'min'; ties go to
    the newer step; a missing or NaN value is never among the best)."""
    steps = sorted(scores)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    sign = -1.0 if mode == "max" else 1.0
    ranked = sorted(
        (s for s in steps if scores[s] is not None and math.isfinite(scores[s])),
        key=lambda s: (sign * scores[s], -s),
    )
    keep.update(ranked[:keep_best])
    return [s for s in steps if s not in keep]


def checkpoint_step(ckpt: Path) -> int:
    return int(Path(ckpt).name.split("-")[1])


def prune(run_dir: Path, keep_last: int, keep_best: int, mode: str) -> list[Path]:
    """Delete the complete checkpoints `to_prune` names (by their state's `score`); returns them."""
    found = {checkpoint_step(p): p for p in list_checkpoints(run_dir)}
    scores = {}
    for step, path in found.items():
        try:
            scores[step] = json.loads((path / STATE_FILE).read_text()).get("score")
        except (OSError, json.JSONDecodeError):
            scores[step] = None
    gone = [found[s] for s in to_prune(scores, keep_last, keep_best, mode)]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def save_checkpoint(
    run_dir: Path, step: int, ranks: list[Any], state: dict, keep: tuple[int, int, str], timeout: float
) -> Path:
    """Write `step-N` (every learner rank's DeepSpeed state plus `state`), then prune with
    `keep` = (keep_last, keep_best, mode); `state['score']` is what keep_best ranks."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    refs = [r.save_checkpoint.remote(str(tmp / LEARNER_DIR), {}) for r in ranks]
    _, pending = wait_until(refs, len(refs), time.monotonic() + timeout)
    if pending:
        raise CheckpointError(f"learner checkpoint into {tmp} not written within {timeout:.0f}s")
    ray.get(refs)
    commit(tmp, final, state)
    prune(run_dir, *keep)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder bottom-up (their entries), then `folder`."""
    for dirpath, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _aside(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def commit(tmp: Path, final: Path, state: dict) -> None:
    """Make the written folder `tmp` the checkpoint `final`: the state file and its COMPLETE marker,
    everything fsynced, then the rename (an older `final` is moved aside first, removed after)."""
    state_path = tmp / STATE_FILE
    state_path.write_text(json.dumps({"format": FORMAT, **state}, indent=1))
    (tmp / COMPLETE).write_text(_sha256(state_path) + "\n")
    fsync_tree(tmp)
    old = _aside(final)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)  # the new entry (and the one moved aside) reach the disk
    shutil.rmtree(old, ignore_errors=True)


def _restore_aside(root: Path) -> None:
    """A crash between moving an old `step-N` aside and renaming the new one in left only the old
    one: put it back (a complete `step-N` wins; a leftover `.step-N.old` beside it is deleted)."""
    for old in root.glob(".step-*.old"):
        final = root / old.name[1 : -len(".old")]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        elif (old / COMPLETE).is_file():
            os.rename(old, final)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    _restore_aside(root)
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / COMPLETE).is_file()
    ]
    return sorted(found, key=checkpoint_step)


def read_state(ckpt: Path) -> dict:
    marker, state_path = ckpt / COMPLETE, ckpt / STATE_FILE
    if not marker.is_file():
        raise CheckpointError(f"{ckpt}: incomplete checkpoint (no {COMPLETE} marker)")
    if not state_path.is_file() or not (ckpt / LEARNER_DIR).is_dir():
        raise CheckpointError(f"{ckpt}: corrupt checkpoint (missing {STATE_FILE} or {LEARNER_DIR}/)")
    if marker.read_text().strip() != _sha256(state_path):
        raise CheckpointError(f"{ckpt}: corrupt checkpoint ({STATE_FILE} does not match its checksum)")
    try:
        state = json.loads(state_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{ckpt}: corrupt {STATE_FILE}: {err}") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: checkpoint format {state.get('format')} is not {FORMAT}")
    return state


def latest_checkpoint(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume: run folder not found: {run_dir}")
    found = list_checkpoints(run_dir)
    if not found:
        partial = (
            sorted(p.name for p in checkpoint_root(run_dir).glob("*"))
            if checkpoint_root(run_dir).is_dir()
            else []
        )
        extra = f" (only incomplete: {', '.join(partial)})" if partial else ""
        raise CheckpointError(f"--resume: {run_dir} holds no complete checkpoint{extra}")
    read_state(found[-1])  # validate now: a corrupt newest checkpoint is an error, not a fallback
    return found[-1]


def find_auto_resume(output_dir: str, name: str) -> Path:
    """The newest run folder of this run name that holds a complete checkpoint."""
    root = Path(output_dir)
    runs = sorted(
        (p for p in root.glob(f"{name}-*") if p.is_dir() and list_checkpoints(p)),
        key=lambda p: p.stat().st_mtime,
    )
    if not runs:
        raise CheckpointError(f"--resume auto: no run folder {root}/{name}-* with a complete checkpoint")
    return runs[-1]
