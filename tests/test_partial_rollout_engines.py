"""Interruptible generation (`pipeline.partial_rollout`), one contract for every engine: `hf` always,
`vllm` where vLLM imports (`make test-vllm`).

- With no weights due, an interruptible call samples exactly what a plain call samples (same seed),
  and tags every token with the version held.
- With new weights let in part-way (a real load, from another thread, through the worker's gate):
  the tokens before the swap are those of the uninterrupted generation, every token's version is
  non-decreasing, the sample's version is its oldest token's, and the behaviour logprobs of the tokens
  after the swap are the new weights' teacher-forced logprobs (the KV cache was recomputed), while
  those before it are the old weights'.
- A load let in before the first token: every token and the sample are the new version's.
- A load that fails inside a generation fails that call instead of sampling from unknown weights.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from engine_contract_shared import ENGINES, INDICES, PROMPTS, TOL, bundle_of, teacher_forced_gap

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.worker import RolloutWorker

SAMPLING = SamplingConfig(n=3, max_new_tokens=40, temperature=1.0)
CUT_AT = 6  # the interruption point (counted from the call's start) where the test's load cuts in


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> tuple[str, str]:
    from tiny_models import build_policy

    root = tmp_path_factory.mktemp("partial")
    a = build_policy(root / "a", seed=0, n_embd=64)
    b = build_policy(root / "b", seed=1, n_embd=64)
    return str(a), str(b)


@pytest.fixture(scope="module", params=ENGINES)
def worker(request, policies) -> RolloutWorker:
    return RolloutWorker(
        policies[0], RolloutConfig(engine=request.param, interruptible=True), initial_version=0
    )


class NeverDue:
    version = 7

    def due(self) -> bool:
        return False

    def swap(self) -> None:  # pragma: no cover - never called
        raise AssertionError("swap without a due load")


def test_no_weights_due_gives_the_plain_generation(worker):
    engine = worker._engine
    plain = engine.generate(PROMPTS, SAMPLING, 5)
    cut = engine.generate(PROMPTS, SAMPLING, 5, interrupt=NeverDue())
    for a_outs, b_outs in zip(plain, cut, strict=True):
        for a, b in zip(a_outs, b_outs, strict=True):
            np.testing.assert_array_equal(a.response_ids, b.response_ids)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
            assert a.finish_reason == b.finish_reason and a.versions is None
            assert b.versions.tolist() == [7] * len(b.response_ids)
    samples = worker.generate(INDICES, PROMPTS, 5, SAMPLING)
    assert all(s.token_versions is None and s.policy_version == worker.version() for s in samples)


def _hold_at_cut(worker: RolloutWorker, at: int = CUT_AT) -> threading.Event:
    """From the worker's `at`-th interruption point on, its generation asks for due loads only once one
    waits (so the test's load, made from another thread, lands exactly there). Returns an event set
    when the generation reached that point."""
    gate, real, calls, reached = worker._gate, worker._gate.load_due, [0], threading.Event()

    def load_due() -> bool:
        calls[0] += 1
        if calls[0] == at:
            reached.set()
            deadline = time.monotonic() + 120
            while not real() and time.monotonic() < deadline:
                time.sleep(0.001)
        return real()

    gate.load_due = load_due
    return reached


def test_weights_let_in_part_way_continue_the_same_sequences(worker, policies):
    a, b = policies
    start = worker.version()
    before = worker.generate(INDICES, PROMPTS, 9, SAMPLING)  # uninterrupted, weights A
    reached = _hold_at_cut(worker)
    out: dict = {}
    gen = threading.Thread(target=lambda: out.update(samples=worker.generate(INDICES, PROMPTS, 9, SAMPLING)))
    gen.start()
    try:
        assert reached.wait(120)
        ack = worker.load_weights(bundle_of(b), start + 1)  # blocks until the generation lets it in
    finally:
        gen.join(120)
        del worker._gate.load_due  # the instance attribute the test set
    assert ack.version == start + 1 and "samples" in out
    samples = out["samples"]
    assert worker.stats()["loads_inside_generation"] >= 1
    cut = CUT_AT - 1  # tokens sampled before the load (hf: one interruption point per token)
    spanning = 0
    for s, plain in zip(samples, before, strict=True):
        versions = s.versions()
        assert s.policy_version == start == versions.min()
        assert (np.diff(versions) >= 0).all() and set(versions.tolist()) <= {start, start + 1}
        if worker._engine.name == "hf":  # one interruption point per token
            assert (versions[:cut] == start).all() and (versions[cut:] == start + 1).all()
        k = int((versions == start).sum())
        np.testing.assert_array_equal(s.response_ids[:k], plain.response_ids[:k])
        head, tail = _split(s, k)
        assert teacher_forced_gap(a, [head], 1.0) < TOL
        if k < len(s.response_ids):
            spanning += 1
            assert teacher_forced_gap(b, [tail], 1.0) < TOL, "tokens after the swap must be the new weights'"
    assert spanning >= len(samples) // 2  # most responses are longer than the cut
    worker.load_weights(bundle_of(a), start + 2)  # the module's other tests expect policy A


def test_a_load_before_the_first_token_tags_the_samples_with_the_new_version(worker, policies):
    """A load that cuts in at the call's first interruption point, before any token is sampled: every
    token is the new version's, and so is each sample's version (its oldest token's), not the version
    the call began with; `token_versions` stays None (every token has the sample's version)."""
    a, b = policies
    start = worker.version()
    reached = _hold_at_cut(worker, at=1)
    out: dict = {}
    gen = threading.Thread(target=lambda: out.update(samples=worker.generate(INDICES, PROMPTS, 9, SAMPLING)))
    gen.start()
    try:
        assert reached.wait(120)
        worker.load_weights(bundle_of(b), start + 1)  # blocks until the generation lets it in
    finally:
        gen.join(120)
        del worker._gate.load_due  # the instance attribute the test set
    samples = out["samples"]
    assert [s.policy_version for s in samples] == [start + 1] * len(samples)
    assert all(s.token_versions is None for s in samples)
    assert teacher_forced_gap(b, samples, 1.0) < TOL  # sampled by the new weights only
    worker.load_weights(bundle_of(a), start + 2)  # the module's other tests expect policy A


def _split(sample, k: int):
    """The sample's first k tokens as one sample and the rest as another whose prompt is all before it."""
    import dataclasses

    head = dataclasses.replace(sample, response_ids=sample.response_ids[:k], logprobs=sample.logprobs[:k])
    tail = dataclasses.replace(
        sample,
        prompt_ids=np.concatenate([sample.prompt_ids, sample.response_ids[:k]]),
        response_ids=sample.response_ids[k:],
        logprobs=sample.logprobs[k:],
    )
    return head, tail


def test_a_refused_load_inside_a_generation_changes_nothing(worker, policies):
    """A bundle the model refuses (checked before anything is written) raises in the loader's thread;
    the generation goes on with the weights it had: every token is the old version's, with the old
    weights' logprobs. (hf continues the same sequences untouched, so its tokens equal the uninterrupted
    ones; vLLM's requests were already aborted to let the load in and continue with a new seed.)"""
    start = worker.version()
    plain = worker.generate(INDICES, PROMPTS, 3, SAMPLING)
    reached = _hold_at_cut(worker)
    out: dict = {}
    gen = threading.Thread(target=lambda: out.update(samples=worker.generate(INDICES, PROMPTS, 3, SAMPLING)))
    gen.start()
    bad = bundle_of(policies[1])
    bad["transformer.wte.weight"] = bad["transformer.wte.weight"][:5]  # a shape the model refuses
    try:
        assert reached.wait(120)
        with pytest.raises(ValueError):
            worker.load_weights(bad, start + 1)
    finally:
        gen.join(120)
        del worker._gate.load_due
    samples = out["samples"]
    assert worker.version() == start and all(s.token_versions is None for s in samples)
    assert teacher_forced_gap(policies[0], samples, 1.0) < TOL
    if worker._engine.name == "hf":
        assert [s.response_ids.tolist() for s in samples] == [s.response_ids.tolist() for s in plain]


def test_weights_left_unknown_by_a_load_fail_the_generation(worker):
    """A load that failed part-way leaves the weights unknown: the generation that let it in stops
    with an error instead of sampling from them."""
    from rollout_workers.worker import _CutIn

    engine = worker._engine
    engine._unknown_weights = "a weight load failed part-way"
    try:
        with pytest.raises(RuntimeError, match="failed part-way"):
            _CutIn(worker).swap()
    finally:
        engine._unknown_weights = None
