"""One contract, every rollout engine: `hf` always, `vllm` where vLLM imports (`make test-vllm`).
This half: generation.

Through `RolloutWorker`, on a tiny GPT-2 with tied embeddings and head_dim 32 (vLLM's CPU attention
needs >= 32): the same `Sample` records; behaviour logprobs equal to a float32 teacher-forced
transformers forward of the same weights (max gap < 1e-4; measured ~1e-6 for both engines), also under
top_k/top_p truncation; EOS and 'length' finish reasons; n > 1; same seed -> same samples; bad input
gives a named error. The weights half (swaps, acknowledgements, refused bundles, sleep / wake-up,
broadcast) is tests/test_engine_weights_contract.py; the engines, policies, fixtures and references
both use are tests/engine_contract_shared.py.
"""

from __future__ import annotations

import engine_contract_shared
import numpy as np
import pytest
import torch
from engine_contract_shared import (
    CONTEXT,
    EOS,
    INDICES,
    PROMPTS,
    TOL,
    VOCAB,
    sample_key,
    teacher_forced_gap,
)

from rollout_workers.config import SamplingConfig
from rollout_workers.types import Sample

# The shared module-scoped fixtures (this module gets its own policies and one worker per engine).
policies, worker = engine_contract_shared.policies, engine_contract_shared.worker


def test_sample_records_and_finish_reasons(worker):
    version = worker.version()
    samples = worker.generate(INDICES, PROMPTS, seed=0, sampling=SamplingConfig(n=8, max_new_tokens=20))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, k) for i in INDICES for k in range(8)]
    for s, prompt in zip(samples, [p for p in PROMPTS for _ in range(8)], strict=True):
        assert isinstance(s, Sample) and s.policy_version == version
        np.testing.assert_array_equal(s.prompt_ids, prompt)
        assert s.prompt_ids.dtype == s.response_ids.dtype == np.int64
        assert s.logprobs.dtype == np.float32 and s.logprobs.shape == s.response_ids.shape
        assert 1 <= len(s.response_ids) <= 20 and ((s.response_ids >= 0) & (s.response_ids < VOCAB)).all()
        assert np.isfinite(s.logprobs).all() and (s.logprobs <= 0).all()
        assert EOS not in s.response_ids[:-1].tolist()
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == EOS
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 20
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    # n > 1: the samples of one prompt are different draws
    assert len({tuple(s.response_ids.tolist()) for s in samples if s.prompt_index == 11}) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_teacher_forced_forward(worker, policies, temperature):
    samples = worker.generate(
        INDICES, PROMPTS, seed=1, sampling=SamplingConfig(n=4, max_new_tokens=16, temperature=temperature)
    )
    gap = teacher_forced_gap(policies[0], samples, temperature)
    assert gap < TOL, f"behaviour logprobs differ from the teacher-forced forward by {gap}"


def test_truncated_sampling_records_the_distribution_sampled_from(worker, policies):
    """top_k/top_p on: every token is inside the kept set and its behaviour logprob is that of the
    truncated, renormalised distribution (one rule for every engine), not of the full one."""
    k, p, t = 6, 0.9, 0.8
    samples = worker.generate(
        INDICES,
        PROMPTS,
        seed=3,
        sampling=SamplingConfig(n=4, max_new_tokens=16, temperature=t, top_k=k, top_p=p),
    )
    assert teacher_forced_gap(policies[0], samples, t, k, p) < TOL
    # Not the full distribution's: renormalising over at most 6 of the tokens raises every logprob.
    assert teacher_forced_gap(policies[0], samples, t) > 10 * TOL


def test_top_k_one_is_greedy_whatever_the_seed(worker, policies):
    """top_k=1 (eval.greedy, the judge's score verdict): every token is the argmax of the teacher-forced
    forward (any other token would be outside the kept set: an infinite gap), its logprob 0, and the
    seed changes nothing."""
    sampling = SamplingConfig(n=2, max_new_tokens=12, temperature=0.7, top_k=1)
    first = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    other = worker.generate(INDICES, PROMPTS, seed=6, sampling=sampling)
    assert sample_key(first) == sample_key(other)
    assert teacher_forced_gap(policies[0], first, 0.7, top_k=1) < TOL
    assert all(np.abs(s.logprobs).max() < TOL for s in first)


def test_same_seed_same_samples_other_seed_differs(worker):
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    first = worker.generate(INDICES, PROMPTS, seed=123, sampling=sampling)
    torch.manual_seed(999)  # the global RNG must not matter
    again = worker.generate(INDICES, PROMPTS, seed=123, sampling=sampling)
    other = worker.generate(INDICES, PROMPTS, seed=124, sampling=sampling)
    assert sample_key(first) == sample_key(again) and sample_key(first) != sample_key(other)
    np.testing.assert_allclose(
        np.concatenate([s.logprobs for s in first]), np.concatenate([s.logprobs for s in again]), atol=1e-6
    )


def test_bad_input_gives_a_named_error(worker):
    sampling = SamplingConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 42 must be a non-empty"):
        worker.generate([1, 42], [PROMPTS[0], np.array([], dtype=np.int64)], seed=0, sampling=sampling)
    with pytest.raises(ValueError, match=rf"prompt 9 has token ids outside \[0, {VOCAB}\)"):
        worker.generate([9], [np.array([1, VOCAB])], seed=0, sampling=sampling)
    with pytest.raises(ValueError, match=f"prompt 4 has 60 tokens.*exceeds the model's {CONTEXT} positions"):
        worker.generate([4], [np.ones(60, dtype=np.int64)], seed=0, sampling=sampling)
    assert len(worker.generate([4], [np.ones(CONTEXT - 8, dtype=np.int64)], seed=0, sampling=sampling)) == 1


def test_every_registered_engine_runs_this_suite():
    """A backend added to the registry (rollout_workers.engines) is held to the contract here."""
    from rollout_workers.engines import ENGINES

    assert [p.values[0] for p in engine_contract_shared.ENGINES] == list(ENGINES.names())
