"""The discrete-event projection of bench/bench_async.py against hand-worked steady states."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench():
    import sys

    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_async", BENCH / "bench_async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_is_the_sum_of_the_phases():
    b = _bench()
    # 16 chunks of 50 ms on 1 worker, 50 ms scoring tail, 300 ms train, 100 ms push: 1.25 s per step.
    assert b.simulate(1, 16, 0.05, 0.05, 0.3, 0.1, eta=0) == pytest.approx(0.8)
    # 4 workers: 4 rounds of 50 ms -> 0.2 + 0.05 + 0.4 = 0.65 s per step.
    assert b.simulate(4, 16, 0.05, 0.05, 0.3, 0.1, eta=0) == pytest.approx(1 / 0.65)


def test_async_is_bound_by_the_slower_of_generation_and_learning():
    b = _bench()
    # Generation (0.8 s per batch) is the bottleneck: one step per 0.8 s after the pipeline fills.
    assert b.simulate(1, 16, 0.05, 0.05, 0.3, 0.1, eta=1, steps=400) == pytest.approx(1 / 0.8, rel=0.01)
    # With 16 workers the learner (0.4 s) is: one step per 0.4 s.
    assert b.simulate(16, 16, 0.05, 0.05, 0.3, 0.1, eta=1, steps=400) == pytest.approx(1 / 0.4, rel=0.01)


def test_projection_never_makes_async_slower():
    b = _bench()
    rows = b.projection({"g": 0.1, "s": 0.04, "t": 0.3, "u": 0.06}, chunks=2, eta=1)
    assert all(speedup >= 1.0 - 1e-9 for *_, speedup in rows)
