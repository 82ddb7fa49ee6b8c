"""Chunked token logprobs (issue 39): `learner.chunked_logprobs` against the full `[tokens, vocabulary]`
computation, and the learner's forward with and without `logits_chunk_tokens`.

float64: equal to the unchunked reference within 1e-12 (values and gradients w.r.t. hidden states,
lm_head weight and bias); float32 within 1e-4 of the largest entry (sums taken in another order over logits spanning +-30)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import build_causal_lm
from transformers import AutoConfig

from learner.algorithms import entropy_from_logits, logprobs_from_logits
from learner.batch import pack_trajectories
from learner.chunked_logprobs import chunked_token_scores, linear_logits_reason
from learner.config import LearnerConfig
from learner.forward import forward_scores
from learner.model import PolicyWithValueHead
from learner.trajectory import Trajectory

N, H, V = 37, 16, 101  # 37 positions: no chunk size below divides it


def _inputs(dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=gen) * 2).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=gen) * 0.5).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, b, targets


def _loss(logp, ent, seed: int = 1):
    """A loss with different weights per position on both outputs (exercises g and e separately)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(logp.dtype)
    e = torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(logp.dtype)
    return (g * logp).sum() + (e * ent).sum()


def _reference(hidden, weight, bias, targets, temperature):
    """The unchunked computation, as the learner's full-logits path runs it (float64 in float64)."""
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    if logits.dtype == torch.float32:
        return logprobs_from_logits(logits, targets), entropy_from_logits(logits)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-4)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_scores_and_gradients_equal_the_full_computation(dtype, tol, bias, temperature):
    inputs = _inputs(dtype, bias)
    params = [t for t in inputs[:3] if t is not None]
    want = _reference(*inputs, temperature)
    want_grads = torch.autograd.grad(_loss(*want), params)
    for chunk in (1, 5, 8, 36, 37, 1000):
        got = chunked_token_scores(*inputs, temperature, chunk_tokens=chunk, entropy=True)
        got_grads = torch.autograd.grad(_loss(*got), params)
        for name, g, w in zip(("logp", "entropy"), got, want, strict=True):
            assert g.dtype == w.dtype
            torch.testing.assert_close(
                g,
                w,
                atol=tol * max(1.0, float(w.detach().abs().max())),
                rtol=0,
                msg=lambda m, n=name: f"{n}: {m}",
            )
        for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=False):
            scale = max(1.0, float(w.abs().max()))
            torch.testing.assert_close(
                g, w, atol=tol * scale, rtol=0, msg=lambda m, c=chunk, n=name: f"chunk {c}: d/d{n}: {m}"
            )


def test_without_entropy_only_logprobs_carry_a_gradient():
    hidden, weight, _, targets = _inputs(torch.float64, bias=False)
    logp, ent = chunked_token_scores(hidden, weight, None, targets, 0.9, chunk_tokens=4)
    assert ent is None
    want = _reference(hidden, weight, None, targets, 0.9)[0]
    torch.testing.assert_close(logp, want, atol=1e-12, rtol=0)
    got = torch.autograd.grad(logp.sum(), [hidden, weight])
    ref = torch.autograd.grad(want.sum(), [hidden, weight])
    for g, w in zip(got, ref, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_only_linear_output_paths_qualify():
    assert linear_logits_reason(AutoConfig.for_model("qwen2")) is None
    assert linear_logits_reason(AutoConfig.for_model("gpt2")) is None
    assert "softcapping" in linear_logits_reason(AutoConfig.for_model("llama", final_logit_softcapping=30.0))
    assert "gemma2" in linear_logits_reason(AutoConfig.for_model("gemma2"))
    assert "cohere" in linear_logits_reason(AutoConfig.for_model("cohere"))


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    trajs = []
    for _ in range(5):
        r = int(rng.integers(1, 9))
        p = rng.integers(4, 28, size=int(rng.integers(1, 6)))
        trajs.append(
            Trajectory(p, rng.integers(4, 28, size=r), np.zeros(r, np.float32), np.zeros(r, np.float32), 0.0)
        )
    return pack_trajectories(trajs, pad_id=0)


@pytest.fixture(scope="module", params=["gpt2", "qwen2", "llama"])
def family(request, tmp_path_factory):
    """GPT-2 and the tests' Qwen2 tie lm_head to the input embeddings; their Llama does not."""
    return build_causal_lm(tmp_path_factory.mktemp(request.param), request.param, seed=5)


@pytest.mark.parametrize("packed", [False, True])
def test_the_learner_forward_scores_the_same_chunked(family, packed):
    """forward_scores with logits_chunk_tokens=3 and without: logprobs, values (bootstrap position
    included), entropies and every parameter's gradient, float32, temperature 0.7."""
    batch = _batch()
    results = []
    for chunk in (None, 3):
        torch.manual_seed(0)
        model = PolicyWithValueHead.from_pretrained(family, value_head_std=0.1, logits_chunk_tokens=chunk)
        s = forward_scores(model, batch, 0.7, extra=1, packed=packed, entropy=True)
        mask = torch.cat([batch.mask, torch.zeros(len(batch), 1)], 1)
        mask[torch.arange(len(batch)), batch.response_lens] = 1.0
        m = mask.bool()
        loss = (s.logprobs * m).sum() + 0.3 * (s.entropy * m).sum() + (s.values * m).sum() + s.anchor * 0
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((s.logprobs[m], s.values[m], s.entropy[m], grads))
    (lp0, v0, e0, g0), (lp1, v1, e1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=0)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=0)
    assert g1.keys() == g0.keys() and any(w in k for k in g0 for w in ("lm_head", "wte", "embed"))
    for k in g0:
        scale = max(1.0, float(g0[k].abs().max()))
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5 * scale, rtol=0, msg=k)


def test_the_anchor_reaches_every_parameter(family):
    model = PolicyWithValueHead.from_pretrained(family, logits_chunk_tokens=2)
    s = forward_scores(model, _batch(), 1.0)
    (s.anchor * float("nan") + s.values.sum() * 0).backward()
    for k, p in model.policy.named_parameters():
        assert p.grad is not None and torch.isnan(p.grad).any(), k  # unused positions: 0


@pytest.mark.parametrize("name", ["gemma2", "cohere", "granite"])
def test_chunking_an_unsupported_architecture_is_refused(tmp_path, name):
    """A softcap (Gemma-2), a logit scale (Cohere) or divisor (Granite): 'auto' keeps the full logits
    path, an explicit chunk size is refused."""
    path = build_causal_lm(tmp_path, name)
    with pytest.raises(ValueError, match=f"logits_chunk_tokens=8 needs .*{name}"):
        PolicyWithValueHead.from_pretrained(path, logits_chunk_tokens=8)
    assert PolicyWithValueHead.from_pretrained(path, logits_chunk_tokens="auto").logits_chunk_tokens is None


def test_config_field():
    assert LearnerConfig().logits_chunk_tokens == "auto"
    with pytest.raises(ValueError):
        LearnerConfig(logits_chunk_tokens=0)


@pytest.mark.slow
@pytest.mark.parametrize("family_name", ["gpt2", "llama"])
def test_zero3_ranks_chunked_take_the_steps_of_one_rank_unchunked(ray_local, tmp_path, family_name):
    """2 real ZeRO-3 ranks (gloo, every tensor sharded), chunks of 5 tokens, uneven shards (the short rank
    runs zero-weight micro-batches through the anchor) vs 1 rank on the full logits path: the same
    weights and metrics; a NaN score still skips the step on both ranks. GPT-2 ties the lm_head
    to the input embeddings (one sharded parameter read by two modules), the case ZeRO-3 makes
    fragile; Llama's head is untied."""
    from test_learner_ranks import (
        _assert_same_weights,
        _assert_step_skipped,
        _config,
        _train,
        _trajectories,
        _weights,
        learner_group,
    )

    ray = ray_local
    path = build_causal_lm(tmp_path, family_name, seed=5)
    z3 = _config(
        zero_stage=3,
        logits_chunk_tokens=5,
        deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    batch = _trajectories(9, seed=3)
    with (
        learner_group(ray, 1, path, _config(logits_chunk_tokens=None)) as one,
        learner_group(ray, 2, path, z3) as two,
    ):
        m1 = _train(ray, one, [batch])
        m2 = _train(ray, two, [batch[:3], batch[3:]])
        _assert_same_weights(_weights(ray, one), _weights(ray, two))
        for key in ("params/grad_norm", "loss/policy", "loss/value", "loss/entropy", "objective/kl"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        _assert_step_skipped(ray, two, [batch[:4], batch[4:]], z3)
