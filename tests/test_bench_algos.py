"""bench/bench_algos.py gives every side the same generated samples per step and the config accepts each side."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from cluster.config.schema import load_config

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_algos", BENCH / "bench_algos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_algos"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("demo", "n", "labels"),
    [
        ("sentiment", 4, ["gae", "grpo", "rloo"]),
        ("arithmetic", 8, ["gae", "grpo", "grpo+dynamic", "rloo"]),
    ],
)
def test_sides_see_equal_samples_per_step(demo, n, labels):
    b = _bench()
    sides = b.sides(demo, 64, n)
    assert [s.label for s in sides] == labels
    samples, filters = set(), {}
    for side in sides:
        cfg = load_config(ROOT / b.CONFIGS[demo], side.overrides)
        assert cfg.learner.advantage == side.label.split("+")[0]
        samples.add(cfg.data.prompts_per_step * cfg.rollout.sampling.n)
        filters[side.label] = cfg.data.dynamic_sampling.enabled
    assert samples == {64}
    if demo == "arithmetic":  # only the dynamic side filters; gae's groups of one would all be dropped
        assert {k for k, on in filters.items() if on} == {"grpo+dynamic"}
    with pytest.raises(SystemExit, match="must divide"):
        b.sides(demo, 10, 4)
