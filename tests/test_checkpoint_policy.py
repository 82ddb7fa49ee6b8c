"""Checkpoint cadence and retention, the stop request, and run paths: pure logic, no Ray.

The cadence by minutes runs on an injected clock; the stop's grace period on a real timer
(waited for as an event, with a generous bound).
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import pytest

from cluster.config.schema import ConfigError, load_config
from cluster.pipeline import checkpoint as ckpt_mod
from cluster.pipeline.checkpoint import (
    COMPLETE,
    STATE_FILE,
    Cadence,
    commit,
    list_checkpoints,
    prune,
    read_state,
    to_prune,
)
from cluster.pipeline.stopping import EXIT_CODES, StopRequest
from cluster.reporting.folder import resolve_paths
from cluster.submit import CHECKPOINT_MARGIN_S, job_stop_wait_s

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sentiment_tiny.yaml"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_cadence_by_steps_minutes_and_both():
    clock = Clock()
    by_steps = Cadence(every_steps=3, every_minutes=0, clock=clock)
    assert [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9]

    by_time = Cadence(every_steps=0, every_minutes=30, clock=clock)
    clock.t += 29 * 60 + 59
    assert not by_time.due(1)
    clock.t += 1  # 30 minutes since the start
    assert by_time.due(2)
    by_time.written()
    clock.t += 10 * 60
    assert not by_time.due(3)  # counts from the last checkpoint, not the start
    clock.t += 20 * 60
    assert by_time.due(4)

    both = Cadence(every_steps=5, every_minutes=30, clock=clock)
    clock.t += 31 * 60
    assert both.due(1)  # the minutes, though step 1 is no multiple of 5
    both.written()
    assert both.due(5) and not both.due(6)

    off = Cadence(every_steps=0, every_minutes=0, clock=clock)
    clock.t += 10**6
    assert not any(off.due(s) for s in range(1, 50))


def test_to_prune_keeps_the_newest_and_the_best():
    scores = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.7, 5: 0.3}
    assert to_prune(scores, keep_last=2, keep_best=0, mode="max") == [1, 2, 3]
    # best by max: step 2 (0.9) then step 4 (0.7, already kept as one of the newest)
    assert to_prune(scores, keep_last=2, keep_best=1, mode="max") == [1, 3]
    # the best two (2 and 4) may overlap the newest two (4 and 5): three are kept, not four
    assert to_prune(scores, keep_last=2, keep_best=2, mode="max") == [1, 3]
    assert to_prune(scores, keep_last=2, keep_best=3, mode="max") == [3]  # 0.5 (step 1) is third best
    assert to_prune(scores, keep_last=1, keep_best=2, mode="min") == [1, 2, 4]  # keeps 3 (0.1), 5 (0.3)
    assert to_prune(scores, keep_last=10, keep_best=0, mode="max") == []


def test_to_prune_ties_missing_and_nan_scores():
    # a tie goes to the newer step; a missing or NaN score never counts as best
    scores = {1: 0.8, 2: None, 3: 0.8, 4: math.nan, 5: 0.2}
    assert to_prune(scores, keep_last=1, keep_best=1, mode="max") == [1, 2, 4]
    assert to_prune({1: None, 2: math.nan, 3: None}, keep_last=1, keep_best=2, mode="max") == [1, 2]


def _fake_checkpoint(run_dir: Path, step: int, score, complete: bool = True) -> Path:
    d = run_dir / "checkpoints" / f"step-{step:06d}"
    (d / "learner").mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"format": 1, "step": step, "score": score}))
    if complete:
        (d / COMPLETE).write_text("x\n")
    return d


def test_prune_deletes_on_disk_by_the_stored_score(tmp_path):
    for step, score in [(2, 0.4), (4, 0.95), (6, 0.2), (8, 0.5), (10, 0.3)]:
        _fake_checkpoint(tmp_path, step, score)
    partial = _fake_checkpoint(tmp_path, 12, 0.99, complete=False)  # not a checkpoint yet
    gone = prune(tmp_path, keep_last=2, keep_best=1, mode="max")
    assert sorted(p.name for p in gone) == ["step-000002", "step-000006"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000008", "step-000010"]
    assert partial.is_dir()


def _written(root: Path, step: int, payload: str) -> tuple[Path, Path]:
    """A `.step-N.partial` folder as the learner ranks leave it, and its final name."""
    tmp = root / f".step-{step:06d}.partial"
    (tmp / "learner" / "rank-0").mkdir(parents=True)
    (tmp / "learner" / "rank-0" / "shard.bin").write_text(payload)
    (tmp / "learner" / "index.json").write_text("{}")
    return tmp, root / f"step-{step:06d}"


def test_commit_fsyncs_every_file_and_folder_before_the_rename(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    tmp, final = _written(root, 3, "w")
    synced: list[str] = []
    real_fsync, real_rename = ckpt_mod._fsync, ckpt_mod.os.rename
    monkeypatch.setattr(ckpt_mod, "_fsync", lambda p: (synced.append(str(p)), real_fsync(p)))
    renamed_after: list[int] = []
    monkeypatch.setattr(
        ckpt_mod.os, "rename", lambda a, b: (renamed_after.append(len(synced)), real_rename(a, b))
    )
    commit(tmp, final, {"step": 3})
    parts = [tmp / COMPLETE, tmp / STATE_FILE, tmp / "learner/index.json", tmp / "learner/rank-0/shard.bin"]
    folders = [tmp / "learner/rank-0", tmp / "learner", tmp]
    before = set(synced[: renamed_after[0]])
    assert {str(p) for p in parts + folders} <= before  # data and directory entries, before the rename
    assert synced.index(str(tmp / "learner/rank-0")) < synced.index(str(tmp / "learner"))  # bottom-up
    assert synced[-1] == str(root)  # the rename itself reaches the disk
    assert read_state(final)["step"] == 3 and not tmp.exists()


def test_rewriting_a_step_never_leaves_it_missing(tmp_path, monkeypatch):
    """A crash after the old step-N was moved aside and before the new one was renamed in: the old
    one comes back, whole; without a crash the new one replaces it and nothing is left aside."""
    root = tmp_path / "checkpoints"
    tmp, final = _written(root, 5, "old")
    commit(tmp, final, {"step": 5, "which": "old"})
    tmp, final = _written(root, 5, "new")
    real_rename = ckpt_mod.os.rename

    def crash_on_second(a, b):
        if Path(a) == tmp:
            raise OSError("machine lost power")
        real_rename(a, b)

    monkeypatch.setattr(ckpt_mod.os, "rename", crash_on_second)
    with pytest.raises(OSError, match="power"):
        commit(tmp, final, {"step": 5, "which": "new"})
    monkeypatch.setattr(ckpt_mod.os, "rename", real_rename)
    assert not final.exists()  # the window the old code left with nothing at all
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000005"]
    assert read_state(final)["which"] == "old"
    assert (final / "learner/rank-0/shard.bin").read_text() == "old"
    commit(tmp, final, {"step": 5, "which": "new"})
    assert read_state(final)["which"] == "new" and sorted(p.name for p in root.iterdir()) == ["step-000005"]


def test_checkpoint_config_fields_and_errors():
    cfg = load_config(CONFIG)
    ck = cfg.checkpoint
    assert (ck.every_steps, ck.every_minutes, ck.keep_last, ck.keep_best) == (0, 30.0, 2, 0)
    with pytest.raises(ConfigError, match=r"checkpoint.best_mode"):
        load_config(CONFIG, ["checkpoint.best_mode=highest"])
    with pytest.raises(ConfigError, match=r"checkpoint.keep: unknown field"):
        load_config(CONFIG, ["checkpoint.keep=3"])
    with pytest.raises(ConfigError, match=r"checkpoint.stop_grace_s"):
        load_config(CONFIG, ["checkpoint.stop_grace_s=0"])
    assert job_stop_wait_s(load_config(CONFIG, ["checkpoint.stop_grace_s=90.5"])) == 91 + CHECKPOINT_MARGIN_S


def test_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve_paths(load_config(CONFIG, ["reference.model_path=ref", "model.tokenizer_path=~/tok"]))
    assert cfg.run.output_dir == str(tmp_path / "runs")
    assert cfg.model.policy_path == str(tmp_path / "assets/sentiment_tiny/policy")
    assert cfg.data.prompts_path == str(tmp_path / "assets/sentiment_tiny/prompts.jsonl")
    assert cfg.reference.model_path == str(tmp_path / "ref")
    assert cfg.model.tokenizer_path == str(Path.home() / "tok")
    assert cfg.reward.model_path == str(tmp_path / "assets/sentiment_tiny/reward")
    assert cfg.model.demo_assets.folder == str(tmp_path / "assets/sentiment_tiny")
    assert cfg.eval.prompts_path == str(tmp_path / "assets/sentiment_tiny/eval_prompts.jsonl")


def test_stop_request_second_signal_forces():
    stop = StopRequest(grace_s=3600)
    assert not stop.requested and stop.exit_code is None
    stop.request(signal.SIGTERM)
    assert stop.requested and stop.exit_code == 143 and stop.name == "SIGTERM"
    with pytest.raises(KeyboardInterrupt, match="forced"):
        stop.request(signal.SIGINT)
    assert stop.exit_code == 143  # the first signal decides the exit code
    assert EXIT_CODES[signal.SIGINT] == 130


def test_stop_grace_period_forces_through_the_installed_handler():
    # Whatever handler the runner started with (a background or nohup start inherits SIGINT ignored)
    # is the one uninstall must restore.
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest(grace_s=0.2)
    stop.install()
    try:
        with pytest.raises(KeyboardInterrupt, match="forced stop \\(SIGINT\\)"):
            stop.request(signal.SIGINT)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the timer interrupts this loop
                time.sleep(0.05)
    finally:
        stop.uninstall()
    assert {sig: signal.getsignal(sig) for sig in found} == found


def test_safe_point_cancels_the_grace_period():
    stop = StopRequest(grace_s=0.2)
    stop.install()
    try:
        stop.request(signal.SIGTERM)
        stop.reached_safe_point()
        timer_gone = stop._timer is None
        time.sleep(0.6)  # would have fired by now (checks absence: nothing to wait on)
    finally:
        stop.uninstall()
    assert timer_gone
