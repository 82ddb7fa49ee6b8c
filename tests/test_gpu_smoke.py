"""Keeps bench/gpu_smoke.py working between the rare days a GPU is lent: the whole script runs here on
the CPU (gloo, float32, the tiny Qwen2 shape, a LoRA learner) in its own process, without Ray, and every
section must pass its own checks (digest after the load, same tokens after sleep/wake, finite training metrics).

Numbers are not checked: they are the script's report, recorded in docs/benchmarks.md ("GPU smoke")
with the card they came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_smoke_runs_every_section_on_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_smoke.py"), "--lora-rank", "4", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_smoke.json").read_text())
    rows = {r["section"]: r for r in report["rows"]}
    assert list(rows) == [
        "build",
        "generate",
        "behaviour logprobs",
        "sleep/wake",
        "learner",
        "weights",
        "adapter weights",
    ]
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    assert rows["weights"]["facts"]["digest_matches"] and rows["weights"]["facts"]["digest_changed"]
    adapter = rows["adapter weights"]["facts"]  # float32 on CPU: applied adapter = merged weights
    assert adapter["digest_matches"] and adapter["vs_merged_engine_max"] < 1e-3
    assert 0 < adapter["of_merged_bundle"] < 0.2
    assert rows["sleep/wake"]["facts"]["same_tokens"]
    # float32 engine and float32 teacher read the same weights: the sampled tokens' logprobs agree
    assert rows["behaviour logprobs"]["facts"]["vs_fp32_max"] < 1e-3
    assert rows["learner"]["facts"]["tokens_per_step"] > 0


@pytest.mark.slow
def test_gpu_smoke_says_why_sections_are_skipped_without_deepspeed(tmp_path):
    """Without DeepSpeed (not importable, as on a lent GPU image before `gpu_smoke.sh` installs it) the
    learner and weights sections say 'skipped' and why; the rest still run."""
    script = ROOT / "bench" / "gpu_smoke.py"
    absent = (
        "import runpy, sys; sys.modules['deepspeed'] = None; "  # find_spec None, import fails
        f"sys.argv = [{str(script)!r}, '--out', {str(tmp_path)!r}]; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", absent], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["section"]: r for r in json.loads((tmp_path / "gpu_smoke.json").read_text())["rows"]}
    assert rows["learner"]["status"] == "skipped" and "deepspeed does not import" in rows["learner"]["note"]
    assert rows["weights"]["status"] == "skipped"
    assert rows["generate"]["status"] == rows["sleep/wake"]["status"] == "ok"
