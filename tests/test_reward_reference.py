"""ReferencePolicy log-probabilities against an independent per-sequence forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from reward_service.config import ReferenceConfig
from reward_service.reference import ReferencePolicy


def _batch(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    shapes = [(3, 5), (1, 2), (6, 1), (2, 7), (4, 4)]  # prompt/response lengths all differ
    prompts = [rng.integers(3, 28, size=p).astype(np.int64) for p, _ in shapes]
    responses = [rng.integers(3, 28, size=r).astype(np.int64) for _, r in shapes]
    return prompts, responses


def _independent(model, prompt: np.ndarray, response: np.ndarray, temperature: float) -> np.ndarray:
    ids = torch.from_numpy(np.concatenate([prompt, response]))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double() / temperature, dim=-1)
    p, r = len(prompt), len(response)
    pos = torch.arange(p - 1, p + r - 1)
    return logp[pos, torch.from_numpy(response)].numpy()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_unpadded_forward(tiny_policy_dir, temperature):
    prompts, responses = _batch()
    ref = ReferencePolicy(str(tiny_policy_dir), ReferenceConfig(batch_size=2), temperature=temperature)
    got = ref.logprobs(prompts, responses)

    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
    assert len(got) == len(responses)
    for lp, p, r in zip(got, prompts, responses, strict=True):
        assert lp.dtype == np.float32 and lp.shape == (len(r),)
        np.testing.assert_allclose(lp, _independent(model, p, r, temperature), atol=1e-5, rtol=0)
    assert ref.stats()["sequences"] == 5 and ref.stats()["batches"] == 3
    assert ref.stats()["tokens"] == sum(len(r) for r in responses)


def test_logprobs_without_logits_trimming_agree(tiny_policy_dir):
    """The `logits_to_keep` shortcut must not change any value."""
    prompts, responses = _batch(seed=1)
    ref = ReferencePolicy(str(tiny_policy_dir), ReferenceConfig(batch_size=3))
    trimmed = ref.logprobs(prompts, responses)
    ref._can_trim = False
    full = ref.logprobs(prompts, responses)
    for a, b in zip(trimmed, full, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_frozen_and_input_checks(tiny_policy_dir):
    ref = ReferencePolicy(str(tiny_policy_dir), ReferenceConfig())
    assert ref.ping() is True
    assert not any(p.requires_grad for p in ref.model.parameters())
    assert not ref.model.training
    assert ref.logprobs([], []) == []
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        ref.logprobs([np.array([4, 5]), np.array([6])], [np.array([7])])
    with pytest.raises(ValueError, match="temperature"):
        ReferencePolicy(str(tiny_policy_dir), ReferenceConfig(), temperature=0.0)
