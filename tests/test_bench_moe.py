"""Keeps bench/bench_moe.py from rotting: one tiny run (1 seed, 3 prompts x 2 samples, both MoE families)
in a process of its own (the learner rank joins a torch.distributed world), and what it must show:
under R3 every engine-routed expert set of the learner's proximal pass is the engine's and the logprob
gap and behaviour KL shrink; without replay the noisy engine's routing differs for some sets; R2 routes
the step's later minibatch exactly as the proximal pass did; the routers get gradients and move in every
mode. Timings are not read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_the_moe_bench_shows_replay_closing_the_mismatch(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_moe.py"), "--seeds", "0", "--prompts", "3"]
    cmd += ["--max-new-tokens", "6", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(r["family"], r["mode"]) for r in rows} == {
        (f, m) for f in ("qwen3_moe", "mixtral") for m in ("none", "R2", "R3")
    }
    for family in ("qwen3_moe", "mixtral"):
        none, r2, r3 = (
            next(r for r in rows if r["family"] == family and r["mode"] == m) for m in ("none", "R2", "R3")
        )
        assert none["differ"] > 0 and none["sets"] == r3["sets"] > 0
        assert r3["differ"] == 0.0  # every engine-routed (token, layer) set is the engine's
        assert r3["gap"] < none["gap"] and r3["kl_k3"] < none["kl_k3"]
        assert r2["differ"] == none["differ"] and r2["gap"] == pytest.approx(none["gap"])  # R2: own routing
        assert r2["drift"] == 0.0 and r3["drift"] == 0.0
        assert all(r["router_grad"] > 0 and r["router_moved"] > 0 for r in (none, r2, r3))
    assert "| qwen3_moe | R3 | 0.0 % |" in done.stdout and "| mixtral | none |" in done.stdout
