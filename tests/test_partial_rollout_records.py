"""Per-token policy versions in the records and metrics (`pipeline.partial_rollout`), the worker's
weight gate on its own, and the off-policy weights taking each token's own behaviour logprob."""

from __future__ import annotations

import threading

import numpy as np
import torch

from cluster.records.chunks import SampleFacts, sample_facts
from cluster.reporting.metrics import version_metrics
from rollout_workers.types import Sample
from rollout_workers.weight_gate import WeightGate


def _sample(versions, start=3, length=4):
    r = length if versions is None else len(versions)
    return Sample(
        prompt_index=5,
        prompt_ids=np.array([1, 2]),
        response_ids=np.arange(r, dtype=np.int64),
        logprobs=np.zeros(r, dtype=np.float32),
        finish_reason="length",
        policy_version=start,
        token_versions=None if versions is None else np.array(versions, dtype=np.int64),
    )


def test_sample_facts_summarise_the_versions_of_the_tokens():
    spans = sample_facts(_sample([3, 3, 3, 4, 4, 6]))
    assert spans.version == 3 and spans.spans == ((3, 3), (4, 2), (6, 1))
    plain = sample_facts(_sample(None))
    assert plain.spans == () and plain.version == 3
    assert _sample([3, 4]).versions().tolist() == [3, 4]
    assert _sample(None, start=2, length=3).versions().tolist() == [2, 2, 2]


def test_version_metrics_worked_by_hand():
    """Learner at version 6. Sample A: 4 tokens at v3, 2 at v5 (interrupted once); sample B: 2 tokens
    at v6 (never interrupted). Token lags: 4x3 + 2x1 + 2x0 = 14 over 8 tokens = 1.75."""
    a = SampleFacts(0, 3, 6, "stop", None, ((3, 4), (5, 2)))
    b = SampleFacts(1, 6, 2, "stop")
    m = version_metrics([a, b], 6)
    assert m == {
        "staleness/versions_per_response": 1.5,
        "staleness/interrupted_frac": 0.5,
        "staleness/interrupted_segments": 1.0,
        "staleness/token_lag_mean": 1.75,
    }


def test_the_gate_lets_a_waiting_load_in_at_the_holders_interruption_point():
    gate, order = WeightGate(), []
    holding, load_done = threading.Event(), threading.Event()

    def generation() -> None:
        with gate.hold():
            holding.set()
            for t in range(1000):
                if gate.load_due():
                    order.append(f"cut at {t}")
                    gate.let_loads_in()
                    order.append("resumed")
                    return
                threading.Event().wait(0.001)

    def load() -> None:
        with gate.hold(load=True):
            order.append("load")
        load_done.set()

    g = threading.Thread(target=generation)
    g.start()
    assert holding.wait(60)
    loader = threading.Thread(target=load)
    loader.start()
    assert load_done.wait(60)
    g.join(60)
    loader.join(60)
    assert order[0].startswith("cut at") and order[1:] == ["load", "resumed"]
    assert gate.cut_ins == 1 and not gate.load_due()


def test_without_interruption_points_a_load_waits_for_the_holder():
    """A holder that never calls `let_loads_in` (a generation without partial rollouts, a sleep, a
    fingerprint) keeps the engine until it ends; the load runs after it."""
    gate, order = WeightGate(), []
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with gate.hold():
            held.set()
            release.wait(60)
            order.append("holder done")

    def load() -> None:
        with gate.hold(load=True):
            order.append("load")

    h = threading.Thread(target=holder)
    h.start()
    assert held.wait(60)
    loader = threading.Thread(target=load)
    loader.start()
    while not gate.load_due():  # the load announced itself and waits
        threading.Event().wait(0.001)
    assert order == []
    release.set()
    h.join(60)
    loader.join(60)
    assert order == ["holder done", "load"] and gate.cut_ins == 0


def test_off_policy_weights_use_each_tokens_own_behaviour_logprob():
    """A response whose first two tokens were sampled by version 3 and the last two by version 4: the
    learner's batch carries each token's own behaviour logprob (no per-sample value), and the truncated
    importance weights are min(exp(proximal - behaviour), cap) token by token."""
    from cluster.records.trajectories import to_trajectory
    from learner.batch import pack_trajectories
    from learner.losses import off_policy_weights

    sample = _sample([3, 3, 4, 4])
    sample.logprobs = np.array([-1.2, -2.0, -0.4, -3.0], dtype=np.float32)  # v3, v3, v4, v4
    batch = pack_trajectories([to_trajectory(sample, np.zeros(4, np.float32), 1.0)], pad_id=0)
    behaviour = batch.tokens.behaviour_logprobs
    mask = batch.mask
    torch.testing.assert_close(behaviour[0, :4], torch.from_numpy(sample.logprobs))
    proximal = torch.tensor([[-1.0, -2.0, -0.5, -1.5]])
    w, _ = off_policy_weights(proximal, behaviour[:, :4], mask[:, :4], "tis", 2.0)
    # by hand: exp(0.2)=1.2214, exp(0)=1, exp(-0.1)=0.9048, exp(1.5)=4.48 -> capped at 2
    torch.testing.assert_close(w, torch.tensor([[1.2214028, 1.0, 0.9048374, 2.0]]))
