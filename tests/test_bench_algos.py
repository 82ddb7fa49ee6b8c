"""bench/bench_algos.py gives every estimator the same samples per step and the config accepts each side."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from demo_run import CONFIG

from cluster.config import load_config

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_algos", BENCH / "bench_algos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sides_see_equal_samples_per_step():
    b = _bench()
    samples = set()
    for est in b.ESTIMATORS:
        cfg = load_config(CONFIG, b.side_overrides(est, 64, 4))
        assert cfg.learner.advantage == est
        samples.add(cfg.data.prompts_per_step * cfg.rollout.sampling.n)
    assert samples == {64}
    with pytest.raises(SystemExit, match="must divide"):
        b.side_overrides("grpo", 10, 4)
