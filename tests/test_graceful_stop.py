"""SIGTERM and SIGINT on the real command line: the step ends, a checkpoint is written, the summary
names the `--resume` command, every process the run started is gone, and the run resumes.

Each run is its own process with its own local Ray. Nothing waits on time alone: the signal is sent
once metrics.jsonl shows a finished step, and the timeouts are generous for a loaded machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from demo_run import CONFIG, SMALL_STEPS, demo_overrides

from cluster.pipeline.checkpoint import latest_checkpoint, list_checkpoints
from cluster.pipeline.stopping import EXIT_CODES

pytestmark = pytest.mark.slow

STEP_WAIT_S = 900  # start-up plus one step, on a machine shared with other CPU-bound work
EXIT_WAIT_S = 600  # the rest of the step, the checkpoint, the summary and Ray's shutdown


def start_run(
    assets, run_dir: Path, steps: int, *extra: str, placement: str = "separate"
) -> subprocess.Popen:
    over = demo_overrides(assets, steps, **SMALL_STEPS, **{"cluster.placement": placement})
    sets = sum((["--set", s] for s in over), [])
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.train", str(CONFIG), *sets, *extra, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its process tree is the run's alone
    )


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int) -> None:
    """Block until metrics.jsonl holds `n` finished steps (the event the signal waits on)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + STEP_WAIT_S
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"no {n} steps within {STEP_WAIT_S}s"
        time.sleep(0.5)


def shm_files() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("deepspeed_")}


def stop_with(sig: int, assets, run_dir: Path, placement: str) -> tuple[str, list[psutil.Process]]:
    """Start a long run, send `sig` after step 1; returns its output and its process tree."""
    proc = start_run(assets, run_dir, 1000, placement=placement)
    tree: list[psutil.Process] = []
    try:
        wait_for_steps(proc, run_dir, 1)
        tree = psutil.Process(proc.pid).children(recursive=True)  # raylet, gcs, dashboard, actors...
        assert len(tree) >= 3
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=EXIT_WAIT_S)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == EXIT_CODES[sig], out[-3000:]
    return out, tree


def assert_nothing_left(tree: list[psutil.Process], shm_before: set[str]) -> None:
    _, alive = psutil.wait_procs(tree, timeout=120)
    names = [f"{p.pid}:{p.name()}" for p in alive if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not names, f"processes of the run still running: {names}"
    assert not (shm_files() - shm_before), "DeepSpeed shared-memory files left behind"


def test_sigterm_checkpoints_stops_everything_and_resumes(demo_assets, tmp_path):
    shm_before = shm_files()
    run_dir = tmp_path / "run"
    out, tree = stop_with(signal.SIGTERM, demo_assets, run_dir, "separate")
    assert "stopped by SIGTERM" in out and "Aborted" not in out
    ckpt = latest_checkpoint(run_dir)
    done = json.loads((ckpt / "state.json").read_text())["step"]
    assert done >= 1 and ckpt.name == f"step-{done:06d}"
    assert f"checkpoint   {ckpt}" in out
    resume = re.search(r"continue with --resume (\S+)\)", out).group(1)
    assert Path(resume) == run_dir
    assert_nothing_left(tree, shm_before)

    # The printed command continues the run: one more step, then a normal end.
    proc = start_run(demo_assets, run_dir, done + 1, "--resume", resume)
    try:
        out, _ = proc.communicate(timeout=STEP_WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert f"resuming from {ckpt.name}" in out and f"finished {done + 1} steps" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, done + 2))
    assert [p.name for p in list_checkpoints(run_dir)][-1] == f"step-{done + 1:06d}"
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert (run_dir / "final" / "tokenizer.json").is_file()  # written by rank 0 with the model
    assert_export_matches_final(list_checkpoints(run_dir)[-1], run_dir / "final", tmp_path / "export")


def assert_export_matches_final(ckpt: Path, final: Path, out: Path) -> None:
    """`cluster.export` of the last checkpoint computes what the learner's own `final/` computes: the
    same weights (fp32 master weights from the checkpoint files; the learner's gathered module weights
    in final/), the same logits, and a tokenizer that encodes alike."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.export import main as export_main

    assert export_main([str(ckpt), str(out), "--dtype", "float32", "--value-head"]) == 0
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == json.loads((ckpt / "state.json").read_text())["step"]
    assert (out / "value_head.safetensors").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    learner = AutoModelForCausalLM.from_pretrained(final, local_files_only=True).eval()
    tok_a, tok_b = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(final)
    text = "the movie was"
    assert tok_a(text)["input_ids"] == tok_b(text)["input_ids"]
    ids = torch.tensor([tok_a(text)["input_ids"] + [5, 9, 11]])
    with torch.no_grad():
        a, b = exported(ids).logits, learner(ids).logits
    assert (a - b).abs().max().item() < 1e-5
    mine, theirs = exported.state_dict(), learner.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    base = AutoModelForCausalLM.from_pretrained(record["base_policy"], local_files_only=True).state_dict()
    assert any(not torch.equal(mine[k], base[k]) for k in base), "the export holds the untrained weights"


def test_ctrl_c_checkpoints_prints_a_run_summary_and_stops_everything(demo_assets, tmp_path):
    """In the demo's own placement (colocated: what `make train` runs, and stops with Ctrl-C); the
    SIGTERM test above stops the separate placement's actors."""
    shm_before = shm_files()
    run_dir = tmp_path / "run"
    out, tree = stop_with(signal.SIGINT, demo_assets, run_dir, "colocated")
    assert "stopped by SIGINT" in out and "interrupted after" in out and "metrics" in out
    ckpt = latest_checkpoint(run_dir)
    assert f"continue with --resume {run_dir}" in out and str(ckpt) in out
    assert_nothing_left(tree, shm_before)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_ends_at_the_step_boundary_and_the_resumed_run_trains_every_prompt_once(
    ray_local, demo_assets, tmp_path, mode
):
    """The stop hook shared by both trainers: a stop asked for while step 1 runs ends the run after
    it with a checkpoint (async: the prompts in flight are recorded); the resumed run completes the
    epoch with each prompt trained once, and its final checkpoint is written once."""
    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(demo_assets.prompts.read_text().splitlines()[:24]) + "\n")
    extra = {
        **SMALL_STEPS,
        "data.prompts_path": prompts,
        "pipeline.mode": mode,
        # The stop hook is the pipeline's, not the placement's: sync runs the demo's colocated placement
        # (one actor), async the separate one it needs.
        "cluster.placement": "colocated" if mode == "sync" else "separate",
    }
    cfg = load_config(CONFIG, demo_overrides(demo_assets, 3, **extra))  # no checkpoint but the stop's
    run_dir = tmp_path / "run"
    trainer = Run(cfg, run_dir)
    try:
        trainer.iteration()  # step 1; the signal arrives while it runs
        trainer.stop.request(signal.SIGTERM)
        summary = trainer.train()
    finally:
        trainer.close()
        trainer.stop.uninstall()
    assert summary.interrupted and summary.steps == 1 and trainer.stop.exit_code == 143
    ckpt = latest_checkpoint(run_dir)
    assert summary.checkpoint == str(ckpt) and ckpt.name == "step-000001"

    cfg.checkpoint.every_steps = 1
    resumed = Run(cfg, run_dir, resume_from=ckpt)
    try:
        done = resumed.train()
        last = resumed.checkpoints.last
        stamp = (last / "state.json").stat().st_mtime_ns
        assert resumed.checkpoint() == last  # the step's checkpoint exists: not written again
        assert (last / "state.json").stat().st_mtime_ns == stamp
    finally:
        resumed.close()
    assert not done.interrupted and done.steps == 3 and last.name == "step-000003"
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-000002", "step-000003"]  # keep_last 2
    assert set(resumed.progress.trained_prompts.values()) == {1}
    assert set(resumed.progress.trained_prompts) == {p.index for p in resumed.prompts}


HELD_RULE = """
import os
import time
from pathlib import Path

from reward_service.rules import register_reward

if os.getpid() != {driver}:  # the scorer actor's start (the driver's preflight imports it too)
    Path({started!r}).touch()
    time.sleep(600)  # set-up waits on this actor while the test interrupts it; the run kills it

@register_reward("held")
def held(prompt, response, meta):
    return 0.0
"""


def test_a_forced_stop_during_set_up_exits_with_its_code_and_leaves_no_actor(
    ray_local, demo_assets, tmp_path, capsys
):
    """Ctrl-C then SIGTERM (a forced stop) while the run's set-up waits on its reward actor: `Run`'s
    constructor stops what it started, and `cluster.train` says so and exits with the first signal's
    code, without a summary (no step ran). Synchronised on the actor's start, not on time."""
    import threading

    from ray._private.state import actors

    from cluster.pipeline.control import control_name
    from cluster.train import main

    started = tmp_path / "scorer-started"
    module = tmp_path / "held_rule.py"
    module.write_text(HELD_RULE.format(driver=os.getpid(), started=str(started)))
    run_id = f"held-{tmp_path.name}"  # the run folder's name: its actors' names start with it
    over = demo_overrides(demo_assets, 2, **SMALL_STEPS, **{"cluster.placement": "separate"})
    rule = ["reward.kind=rule", "reward.rule=held", f"reward.rule_module={module}"]
    sets = sum((["--set", s] for s in [*over, *rule]), [])

    def interrupt() -> None:
        deadline = time.monotonic() + STEP_WAIT_S
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # a stop at the next safe point...
        os.kill(os.getpid(), signal.SIGTERM)  # ...then forced: KeyboardInterrupt inside set-up

    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    rc = main([str(CONFIG), *sets, "--run-dir", str(tmp_path / run_id)])
    sender.join(timeout=60)
    out = capsys.readouterr().out
    assert started.exists()
    assert rc == EXIT_CODES[signal.SIGINT], out[-3000:]
    assert "interrupted by SIGINT during set-up" in out and "run summary" not in out, out[-3000:]
    names = [a for a in actors().values() if a["Name"].startswith(f"{run_id}/")]
    assert names  # the roles had started
    deadline = time.monotonic() + 120  # ray.kill returns before GCS records the death
    while (
        alive := [
            a["Name"]
            for a in actors().values()
            if a["State"] != "DEAD"
            and (a["Name"].startswith(f"{run_id}/") or a["Name"] == control_name(run_id))
        ]
    ) and time.monotonic() < deadline:
        time.sleep(1)
    assert not alive, f"actors of the interrupted set-up still alive: {alive}"


FAILING_RULE = """
from reward_service.rules import register_reward

@register_reward("always_fails")
def always_fails(prompt, response, meta):
    raise RuntimeError("judge down")
"""


def test_a_failed_run_leaves_no_process_or_shm_file(demo_assets, tmp_path):
    """Every process the run started is watched while it runs (its tree grows as actors start). In the
    demo's colocated placement: the rule is scored in the learner rank's own process, so the failure
    ends the run from inside the process that also holds the learner."""
    shm_before = shm_files()
    module = tmp_path / "failing_rule.py"
    module.write_text(FAILING_RULE)
    rule = [
        "reward.kind=rule",
        "reward.rule=always_fails",
        f"reward.rule_module={module}",
        "reward.max_failure_frac=0",
    ]
    log = (tmp_path / "out.log").open("w+")
    over = demo_overrides(demo_assets, 3, **SMALL_STEPS, **{"cluster.placement": "colocated"})
    sets = sum((["--set", s] for s in [*over, *rule]), [])
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.train", str(CONFIG), *sets, "--run-dir", str(tmp_path / "run")],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + STEP_WAIT_S
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the failing run did not end in time"
            with contextlib.suppress(psutil.Error):
                seen.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.seek(0)
    out = log.read()
    assert proc.returncode == 1, out[-3000:]
    assert "rewards failed" in out and "judge down" in out
    assert len(seen) >= 3  # Ray's own processes and the actors were seen
    assert_nothing_left(list(seen.values()), shm_before)
