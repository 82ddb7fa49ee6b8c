"""Keeps bench/gpu_e2e.py working between the rare days a GPU is lent: the whole script (real
`python -m cluster.train` on a local Ray, colocated then separate) runs here on the CPU with the tiny
Qwen2 shape, and every run must finish its steps and load back (checkpoint and final/).

Numbers are not checked beyond their sense: they are the script's report, recorded in
docs/benchmarks.md ("GPU end to end") with the device they came from.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_e2e import (  # noqa: E402
    CPU_SCALE,
    GPU_SCALE,
    RUNS,
    SEPARATE_GPUS,
    SEPARATE_LOGICAL_GPUS,
    overrides,
    step_facts,
)

from cluster.config.schema import load_config  # noqa: E402


def test_step_facts_leave_the_first_step_out_and_divide_the_bundle_by_the_push():
    rows = [
        {"time/generate": 9.0, "time/train": 9.0, "time/step": 20.0, "time/weight_sync": 5.0},
        {"time/generate": 1.0, "time/train": 2.0, "time/step": 4.0, "time/weight_sync": 0.5,
         "throughput/tokens_per_s": 100.0, "rollout/logprob_gap": 0.02},
        {"time/generate": 3.0, "time/train": 4.0, "time/step": 8.0, "time/weight_sync": 1.5,
         "throughput/tokens_per_s": 300.0, "rollout/logprob_gap": float("nan")},
    ]  # fmt: skip
    facts = step_facts(rows, bundle_bytes=2_000_000_000, startup_s=12.0)
    assert facts["generate_s"] == 2.0 and facts["train_s"] == 3.0 and facts["step_s"] == 6.0
    assert facts["tokens_per_s"] == 200.0
    assert facts["weight_sync_s"] == 1.0 and facts["bundle_gb"] == 2.0
    assert facts["push_gb_per_s"] == 2.0  # 2 GB over the mean 1.0 s of steps 2 and 3
    assert facts["logprob_gap"] == 0.02  # NaN (a bypassed step: not measured) left out
    assert facts["startup_s"] == 12.0 and facts["steps"] == 3


@pytest.mark.parametrize("name", list(RUNS))
def test_the_gpu_runs_are_valid_configs(name, tmp_path):
    """The GPU overrides are accepted by the config (checked here, where no GPU is: a run on the
    device must not fail on its config)."""
    assets = SimpleNamespace(prompts=tmp_path / "p.jsonl", reward=tmp_path / "reward")
    run = RUNS[name]
    sets = overrides(run, GPU_SCALE, assets, str(tmp_path / "policy"), 3, gpu=True)
    cfg = load_config(ROOT / "configs" / "sentiment_tiny.yaml", sets)
    assert cfg.cluster.placement == run.placement and cfg.learner.dtype == "bfloat16"
    assert cfg.rollout.weight_sync == run.weight_sync
    if run.weight_sync == "collective":
        assert cfg.rollout.weight_transport == "cuda_ipc"
    if run.placement == "separate":
        total = sum(SEPARATE_GPUS.values())
        assert total == cfg.cluster.num_gpus == SEPARATE_LOGICAL_GPUS
        assert cfg.rollout.num_gpus_per_worker == SEPARATE_GPUS["rollout.num_gpus_per_worker"]
    else:
        assert cfg.learner.num_gpus_per_rank == 1 and cfg.rollout.sleep_level == 1
    cpu = load_config(
        ROOT / "configs" / "sentiment_tiny.yaml", overrides(run, CPU_SCALE, assets, "p", 2, gpu=False)
    )
    assert cpu.learner.num_gpus_per_rank == 0 and cpu.rollout.sleep_level in (0, None)
    assert cpu.rollout.weight_transport == "auto"  # CUDA IPC cannot apply to CPU weights


@pytest.mark.slow
def test_gpu_e2e_runs_every_run_on_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_e2e.py"), "--out", str(tmp_path / "out"),
         "--work", str(tmp_path / "work")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_e2e.json").read_text())
    assert report["device"] == "cpu" and report["model"] == CPU_SCALE.size
    rows = {r["run"]: r for r in report["rows"]}
    assert list(rows) == ["colocated", "separate", "separate-ipc"]
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["checkpoint_loads"] and row["final_loads"]
        facts = row["facts"]
        assert facts["steps"] == 2 and facts["tokens_per_s"] > 0 and facts["push_gb_per_s"] > 0
        assert facts["generate_s"] > 0 and facts["train_s"] > 0 and facts["startup_s"] > 0
        # float32 engine and float32 learner read the same weights: the sampled tokens' logprobs agree
        assert math.isfinite(facts["logprob_gap"]) and abs(facts["logprob_gap"]) < 1e-3
    table = (tmp_path / "out" / "gpu_e2e.md").read_text()
    assert "| colocated | in process | ok |" in table and "| separate | object store | ok |" in table
