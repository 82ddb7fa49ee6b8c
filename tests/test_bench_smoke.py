"""Keeps bench/compare_trl.py from rotting: one tiny step of this project's side, and the TRL side's CLI.

The TRL side itself needs .venv-trl (trl 1.12.0, a one-minute install from PyPI): too slow and too
network-bound for the test suite, so its one-step run is skipped unless that venv is already there.
What always runs: the settings mapping is accepted by bench/trl_runner.py's own argument parser with
the config's values, unmatched settings are refused, and the whole compare script (this project's
Ray side, the standalone timing, the table and the curves) runs one tiny step. Timings are not checked.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from demo_run import CONFIG, demo_overrides

from cluster.config.schema import load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TINY = {
    "data.prompts_per_step": 8,
    "rollout.sampling.max_new_tokens": 6,
    "rollout.chunk_size": 8,  # one chunk: what the colocated placement draws, so both sides draw the same
    "learner.micro_batch_size": 4,
    "learner.num_minibatches": 2,
    "learner.ppo_epochs": 1,
}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_runner_accepts_the_matched_settings():
    compare, runner = _load("compare_trl"), _load("trl_runner")
    cfg = load_config(CONFIG)
    args = runner.parse_args(
        ["run", "--policy=p", "--reward=r", "--prompts=x.json", *compare.trl_args(cfg, 7)]
    )
    lc, s = cfg.learner, cfg.rollout.sampling
    assert (args.steps, args.batch_size) == (7, cfg.data.prompts_per_step * s.n)
    assert (args.num_minibatches, args.ppo_epochs) == (lc.num_minibatches, lc.ppo_epochs)
    assert (args.response_length, args.temperature) == (s.max_new_tokens, s.temperature)
    assert (args.lr, args.kl_coef, args.kl_estimator) == (lc.lr, lc.kl.coef, lc.kl.estimator)
    assert (args.cliprange, args.cliprange_value, args.vf_coef) == (
        lc.clip.eps,
        lc.value_clip_eps,
        lc.vf_coef,
    )
    assert (args.gamma, args.lam, args.adam_betas) == (lc.gamma, lc.params("gae").lam, tuple(lc.adam_betas))


def test_settings_trl_cannot_match_are_refused():
    compare = _load("compare_trl")
    cfg = load_config(CONFIG, ["rollout.sampling.top_k=5", "learner.kl.adaptive=true"])
    with pytest.raises(ValueError, match="top_k.*adaptive KL"):
        compare.trl_args(cfg, 1)


def _compare(tmp_path: Path, demo_assets, sides: str, *extra: str) -> tuple[str, Path]:
    sets = [a for o in demo_overrides(demo_assets, 1, **TINY) for a in ("--set", o)]
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "bench" / "compare_trl.py"), f"--sides={sides}", "--steps=1", *extra]
    cmd += ["--standalone-steps=1", "--wait-idle=0", "--last-n=8", f"--out-dir={out}", *sets]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout, out


def test_compare_runs_one_tiny_step_of_this_project(tmp_path, demo_assets):
    """One cold run of the demo's own placement (colocated), its start-up breakdown, the standalone
    timing, the table and the curves. (Both placements in one table was the default's second cold run,
    ~40 s more; that the two placements compute the same numbers is tests/test_colocated.py's.)"""
    stdout, out = _compare(tmp_path, demo_assets, "ours", "--placements=colocated")
    assert "samples/s (whole run)" in stdout and "end-to-end / standalone" in stdout
    assert stdout.count("to the end of step 1") == 1 and "colocated" in stdout
    result = json.loads((out / "result.json").read_text())
    (step,) = result["this-colocated"]["steps"]
    assert step["samples"] == TINY["data.prompts_per_step"] and 0.0 <= step["reward_prob_mean"] <= 1.0
    assert result["this-colocated"]["peak_pss_mb"] > 100  # Ray's daemons and the actors counted
    assert result["efficiency"]["this-colocated"]["compute"] > 0
    assert "this-separate" not in result
    assert len(result["standalone"]["steps"]) == 1
    rows = list(csv.DictReader((out / "curves.csv").open()))
    assert [r["step"] for r in rows] == ["1"]
    assert float(rows[0]["colocated_p_positive"]) == pytest.approx(step["reward_prob_mean"], rel=1e-5)


@pytest.mark.skipif(
    not (ROOT / ".venv-trl" / "bin" / "python").exists(), reason=".venv-trl not installed (make bench-trl)"
)
def test_trl_side_runs_one_tiny_step(tmp_path, demo_assets):
    stdout, out = _compare(tmp_path, demo_assets, "trl")
    result = json.loads((out / "result.json").read_text())
    assert result["reward_check"]["max_abs_diff"] < 1e-4, result["reward_check"]
    (step,) = result["trl"]["steps"]
    assert step["samples"] == TINY["data.prompts_per_step"] and step["tokens"] > 0
    assert (out / "curves.png").stat().st_size > 0
