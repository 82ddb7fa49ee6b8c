"""Learner throughput features that must not change the math (issue 22): padding-free packing, token-budget
micro-batches, rank balancing by tokens, entropy that costs nothing when unused.

Every comparison is between two computations in the same run (float32): packed vs padded forwards
within 1e-5 for GPT-2, Llama and Qwen2 built from configs; the gradient of a minibatch the same
(within 1e-5) however its rows are cut, for each `loss_agg`; two DeepSpeed ranks with packing and a
token budget take the same steps as one rank cutting by count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_learner_ranks import _assert_same_weights, _config, _train, _weights, learner_group
from tiny_models import build_causal_lm
from transformers import AutoConfig, AutoModelForCausalLM

from kernel.sequences import check_packing_exact, pack_rows
from learner.algorithms import entropy_from_logits
from learner.batch import pack_trajectories
from learner.config import LearnerConfig
from learner.context import LearnerContext
from learner.forward import forward_scores
from learner.model import PolicyWithValueHead
from learner.ppo_step import ppo_update
from learner.prepare import prepare
from learner.trajectory import Trajectory
from reward_service.config import ReferenceConfig
from reward_service.reference import ReferencePolicy

TOL = 1e-5
VOCAB = 28  # tests/tiny_models' word-level tokenizer


def _assert_grad_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within 1e-5 of the tensor's largest entry: the two layouts sum the same float32 terms in a
    different order (a sum of n terms of size g moves by about n * g * 6e-8)."""
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, atol=TOL * scale, rtol=0, msg=lambda m: f"{what}: {m}")


def _long_tail(n: int, seed: int, longest: int = 40) -> list[Trajectory]:
    """Prompts of 1-6 tokens; responses mostly short, a few up to `longest` (a long tail)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = int(rng.integers(1, 6)) if i % 4 else int(rng.integers(longest // 2, longest + 1))
        p = rng.integers(4, VOCAB, size=int(rng.integers(1, 7)))
        resp = rng.integers(4, VOCAB, size=r)
        out.append(
            Trajectory(
                p,
                resp,
                rng.normal(-3.3, 0.2, r).astype(np.float32),
                rng.normal(-3.3, 0.2, r).astype(np.float32),
                float(rng.normal()),
                group=i // 2,
                truncated=bool(i % 3 == 0),
            )
        )
    return out


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2"])
def family(request, tmp_path_factory):
    path = build_causal_lm(tmp_path_factory.mktemp(request.param), request.param, seed=5)
    return request.param, path


def test_packed_and_padded_forwards_agree(family):
    """Logprobs, values (the bootstrap value after each row's last token too), entropies and the
    gradient of a loss on all three: packed equals padded within 1e-5."""
    _, path = family
    torch.manual_seed(0)
    model = PolicyWithValueHead.from_pretrained(path, value_head_std=0.1)
    b = pack_trajectories(_long_tail(7, seed=1, longest=20), pad_id=0)
    counts = b.mask.sum(1).long()
    results = []
    for packed in (False, True):
        model.zero_grad()
        s = forward_scores(model, b, 0.7, extra=1, packed=packed, entropy=True)
        R = b.mask.shape[1] + 1
        valid = torch.arange(R).unsqueeze(0) < (counts + 1).unsqueeze(1)  # response tokens + bootstrap
        scoring = torch.arange(R).unsqueeze(0) < counts.unsqueeze(1)  # response tokens only
        loss = (s.logprobs * scoring).sum() + (s.values * valid).sum() + (s.entropy * scoring).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((s.logprobs * scoring, s.values * valid, s.entropy * scoring, grads))
    (lp0, v0, e0, g0), (lp1, v1, e1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=TOL, rtol=0)
    torch.testing.assert_close(v1, v0, atol=TOL, rtol=0)
    torch.testing.assert_close(e1, e0, atol=TOL, rtol=0)
    assert g0.keys() == g1.keys() and "value_head.weight" in g0
    for k in g0:
        _assert_grad_close(g1[k], g0[k], k)


def test_pack_rows_places_every_output_where_the_padded_layout_has_it():
    """Worked by hand: rows [a b | c], [d | e f g] (prompt | response), one packed row a b c d e f g."""
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]])
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    rows = pack_rows(ids, attn, torch.tensor([2, 1]), torch.tensor([1, 3]), R=3)
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert rows.keep.tolist() == [1, 3, 4, 5]  # b scores c; d, e, f score e, f, g
    assert rows.targets.tolist() == [3, 5, 6, 7]
    assert rows.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1, 0, 0], [2, 3, 4]]


def test_reference_scores_the_same_packed(family, tmp_path):
    _, path = family
    trajs = _long_tail(6, seed=2, longest=16)
    prompts, responses = [t.prompt_ids for t in trajs], [t.response_ids for t in trajs]
    padded = ReferencePolicy(str(path), ReferenceConfig(pack_sequences=False), temperature=0.7)
    packed = ReferencePolicy(str(path), ReferenceConfig(pack_sequences=True, batch_size=4), temperature=0.7)
    for a, b in zip(padded.logprobs(prompts, responses), packed.logprobs(prompts, responses), strict=True):
        np.testing.assert_allclose(b, a, atol=TOL, rtol=0)


def test_an_architecture_that_cannot_pack_is_refused(tmp_path):
    """OPT (learned positions with an offset, its own masking) computes different logits when packed:
    the learner's and the reference's start-up checks refuse it, naming the field and the model."""
    cfg = AutoConfig.for_model(
        "opt",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"learner.pack_sequences: OPTForCausalLM .* does not pack"):
        check_packing_exact(model, VOCAB, "learner.pack_sequences")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"reference.pack_sequences: OPTForCausalLM"):
        ReferencePolicy(str(tmp_path), ReferenceConfig(pack_sequences=True))
    ReferencePolicy(str(tmp_path), ReferenceConfig(pack_sequences=False))  # padded is fine


class GradientTap:
    """Enough of a DeepSpeed engine for `prepare`/`ppo_update` in one process, to read gradients: at
    each optimizer step it keeps the accumulated gradient and clears it instead of stepping. It reports
    the step as applied or not (`step_applied`: what `ppo_update` counts) and, as DeepSpeed does, steps
    its `lr_scheduler` (if any, over an optimizer of its own) after an applied step only."""

    def __init__(self, model: torch.nn.Module, step_applied: bool = False, lr_scheduler=None) -> None:
        self.model, self.device, self.grads = model, torch.device("cpu"), []
        self.step_applied = step_applied
        self.lr_scheduler = lr_scheduler

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def train(self) -> None:
        self.model.train()

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        pass

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        loss.backward()

    def step(self) -> None:
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.model.zero_grad()
        if self.step_applied and self.lr_scheduler is not None:
            self.lr_scheduler.optimizer.step()
            self.lr_scheduler.step()

    def get_lr(self) -> list[float]:
        return self.lr_scheduler.get_last_lr() if self.lr_scheduler is not None else [float("nan")]

    def was_step_applied(self) -> bool:
        return self.step_applied

    def get_global_grad_norm(self) -> float:
        return 0.0


def _minibatch_gradients(path, trajs, **cut) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(path, value_head_std=0.1))
    config = LearnerConfig(**{"ppo_epochs": 1, "num_minibatches": 2, "entropy_coef": 0.01, **cut})
    batch = pack_trajectories(trajs, pad_id=0)
    prepare(LearnerContext(tap, config, 0.7, 0), batch, 0.1)
    ppo_update(LearnerContext(tap, config, 0.7, 0, torch.Generator().manual_seed(3)), batch)
    return tap.grads


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_minibatch_gradient_does_not_depend_on_how_it_is_cut(tmp_path, agg):
    path = build_causal_lm(tmp_path, "qwen2", seed=5)
    trajs = _long_tail(12, seed=3)
    whole = _minibatch_gradients(path, trajs, loss_agg=agg, micro_batch_size=64)
    cuts = {
        "count": {"micro_batch_size": 2},
        "tokens": {"max_tokens_per_micro_batch": 60},
        "tokens+packed": {"max_tokens_per_micro_batch": 60, "pack_sequences": True},
        "packed": {"micro_batch_size": 3, "pack_sequences": True},
    }
    assert len(whole) == 2
    for name, cut in cuts.items():
        got = _minibatch_gradients(path, trajs, loss_agg=agg, **cut)
        assert len(got) == 2
        for g, w in zip(got, whole, strict=True):
            for k in w:
                _assert_grad_close(g[k], w[k], f"{name} {k}")


def test_entropy_in_chunks_matches_whole_and_its_gradient():
    torch.manual_seed(0)
    logits = (torch.randn(3, 700, 50) * 3).requires_grad_()
    whole = entropy_from_logits(logits, chunk_rows=10**9)
    chunked = entropy_from_logits(logits, chunk_rows=256)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    (g_whole,) = torch.autograd.grad(whole.sum(), logits)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), logits)
    torch.testing.assert_close(g_chunked, g_whole, atol=1e-6, rtol=0)


def test_entropy_is_not_computed_when_its_coefficient_is_zero(tmp_path, monkeypatch):
    """With entropy_coef 0 no [B, R, V] entropy is built: the metric is the sampled tokens' -log pi."""
    import learner.model as model_module

    def refuse(*_a, **_k):
        raise AssertionError("entropy_from_logits called with entropy_coef=0")

    path = build_causal_lm(tmp_path, "gpt2", seed=5)
    trajs = _long_tail(6, seed=4)
    torch.manual_seed(0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(path))
    config = LearnerConfig(ppo_epochs=1, entropy_coef=0.0)
    batch = pack_trajectories(trajs, pad_id=0)
    prepare(LearnerContext(tap, config, 0.7, 0), batch, 0.1)
    monkeypatch.setattr(model_module, "entropy_from_logits", refuse)
    ppo_update(LearnerContext(tap, config, 0.7, 0, torch.Generator().manual_seed(3)), batch)
    assert len(tap.grads) == 1


@pytest.mark.slow
def test_two_packed_ranks_under_a_token_budget_take_the_steps_of_one_rank(ray_local, tiny_policy_dir):
    """ZeRO-3, 2 ranks, packed, token budget (uneven micro-batch counts: the short rank runs
    zero-weight micro-batches) vs 1 rank cutting by count: the same weights after two updates."""
    ray = ray_local
    trajs = _long_tail(12, seed=6, longest=30)
    budget = {"max_tokens_per_micro_batch": 40, "pack_sequences": True, "zero_stage": 3}
    with (
        learner_group(ray, 1, tiny_policy_dir, _config(micro_batch_size=3)) as one,
        learner_group(ray, 2, tiny_policy_dir, _config(**budget)) as two,
    ):
        m1 = _train(ray, one, [trajs])
        m2 = _train(ray, two, [trajs[:4], trajs[4:]])
        _assert_same_weights(_weights(ray, one), _weights(ray, two))
        for key in ("params/grad_norm", "loss/policy", "loss/value", "loss/entropy"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_attention_implementation_is_the_configured_one_and_packs_exactly(family, impl):
    _, path = family
    model = PolicyWithValueHead.from_pretrained(path, attn_implementation=impl)
    assert model.policy.config._attn_implementation == impl
    assert check_packing_exact(model.policy, VOCAB, "learner.pack_sequences") < TOL
