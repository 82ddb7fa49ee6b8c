"""bench/async_sim.py, the partial-rollout projection, against timelines worked by hand."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _sim():
    import sys

    spec = importlib.util.spec_from_file_location("async_sim", BENCH / "async_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_sim"] = module  # its dataclass looks the module up while being defined
    spec.loader.exec_module(module)
    return module


def test_sync_one_worker_is_generate_then_train():
    """eta = 0: chunk 1 s, train 1 s, no push cost, nothing overlaps: 2 s per step, the worker idle half
    the time."""
    r = _sim().simulate(1, [[1.0]] * 10, s=0.0, t=1.0, u=0.0, eta=0)
    assert r.steps_per_s == pytest.approx(0.5) and r.generator_idle == pytest.approx(0.5)
    assert r.token_lag == 0.0


def test_async_one_worker_overlaps_generation_with_training():
    """eta = 1: after the first chunk, chunk j+1 runs while step j trains: wall = 1 + 100 x 1 s; every
    batch but the first was sampled one version before it is trained."""
    r = _sim().simulate(1, [[1.0]] * 100, s=0.0, t=1.0, u=0.0, eta=1)
    assert r.steps_per_s == pytest.approx(100 / 101) and r.token_lag == pytest.approx(0.99)


@pytest.mark.parametrize(
    ("policy", "steps_per_s", "token_lag"),
    [
        # chunk 0 at 0-2 (v0), chunk 1 at 2-4 (v0); step 1 trains 2-3, v1 out at 3.5; step 2 trains
        # 4-5, v2 out at 5.5 (the run ends when its last weights are out)
        ("between", 2 / 5.5, (0 * 2 + 1 * 2) / 4),
        # the broadcast waits for chunk 1 (ends at 4), then 0.5: v1 at 4.5; step 2 trains 4.5-5.5, v2 at 6
        ("drain", 2 / 6.0, (0 * 2 + 1 * 2) / 4),
        # v1 cuts into chunk 1 at 3 and is in by 3.5: chunk 1 ends at 4.5, its last 1 s sampled by v1
        # (lag 0), its first 1.5 s by v0 (lag 1); step 2 trains 4.5-5.5, v2 at 6
        ("partial", 2 / 6.0, (0 * 2 + 1 * 1.5 + 0 * 1.0) / 4.5),
    ],
)
def test_two_steps_worked_by_hand(policy, steps_per_s, token_lag):
    """One worker, two chunks of 2 s, train 1 s, weight push 0.5 s, eta = 1, no recompute cost."""
    r = _sim().simulate(1, [[2.0], [2.0]], s=0.0, t=1.0, u=0.5, eta=1, policy=policy)
    assert r.steps_per_s == pytest.approx(steps_per_s)
    assert r.token_lag == pytest.approx(token_lag)


def test_partial_beats_drain_when_a_long_tail_holds_the_broadcast():
    """Many workers, one long chunk per step: without partial rollouts every publication waits for it."""
    sim = _sim()
    rng = random.Random(0)
    gen = [[0.1 * max(sim.longtail_lengths(rng, 4, 8)) for _ in range(16)] for _ in range(40)]
    drain = sim.simulate(16, gen, 0.01, 0.2, 0.05, 1, "drain")
    partial = sim.simulate(16, gen, 0.01, 0.2, 0.05, 1, "partial", r=0.01)
    assert partial.steps_per_s > drain.steps_per_s and partial.token_lag < drain.token_lag
    ks = sim.longtail_lengths(random.Random(1), 5000, 8)
    assert sorted(ks)[2500] == 1 and max(ks) == 8  # median 1 turn, the longest 8x it
