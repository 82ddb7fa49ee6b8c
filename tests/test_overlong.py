"""DAPO overlong reward shaping and overlong filtering (issue #24): the pure functions worked by hand,
their combination with missing_eos_penalty, the loss mask of the filter, and the config fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_learner_packing import GradientTap

from learner.advantages import (
    length_shaped_scores,
    missing_eos_penalty,
    overlong_filter_mask,
    overlong_penalty,
)
from learner.batch import pack_trajectories
from learner.config import LearnerConfig, OverlongConfig
from learner.losses import aggregate_loss, policy_loss, value_loss
from learner.trajectory import Trajectory

VOCAB = 28  # tests/tiny_models' word-level tokenizer


def rows(x: torch.Tensor) -> list[float]:
    return [round(float(v), 12) for v in x]


# ---------------------------------------------------------------------------------- the ramp by hand


def test_overlong_penalty_by_hand_below_inside_and_at_the_end_of_the_buffer():
    # L_max = 10, B = 4, factor 1: the ramp starts after L_max - B = 6 tokens.
    lengths = torch.tensor([1, 3, 6, 7, 8, 9, 10])
    want = [
        0.0,  # L = 1  <= 6: no penalty
        0.0,  # L = 3  <= 6
        0.0,  # L = 6  = L_max - B: the last length without penalty
        -0.25,  # L = 7:  (6 - 7) / 4 * 1 = -1/4
        -0.5,  # L = 8:  (6 - 8) / 4 * 1 = -2/4
        -0.75,  # L = 9:  (6 - 9) / 4 * 1 = -3/4
        -1.0,  # L = 10 = L_max: (6 - 10) / 4 * 1 = -1 = -factor
    ]
    assert rows(overlong_penalty(lengths, 10, 4, 1.0)) == want


def test_overlong_penalty_scales_with_the_factor():
    # L_max = 8, B = 5, factor 0.5: ramp after 3 tokens.
    lengths = torch.tensor([3, 4, 6, 8])
    want = [
        0.0,  # L = 3 = L_max - B
        -0.1,  # L = 4: (3 - 4) / 5 * 0.5 = -0.1
        -0.3,  # L = 6: (3 - 6) / 5 * 0.5 = -0.3
        -0.5,  # L = 8: (3 - 8) / 5 * 0.5 = -0.5 = -factor
    ]
    assert rows(overlong_penalty(lengths, 8, 5, 0.5)) == pytest.approx(want, abs=1e-12)


def test_a_buffer_as_long_as_max_tokens_ramps_over_every_length_and_longer_is_minus_factor():
    # L_max = B = 4: the ramp starts at 0 tokens. L = 1: (0 - 1) / 4 = -0.25; L = 4: -1.
    assert rows(overlong_penalty(torch.tensor([1, 4]), 4, 4, 1.0)) == [-0.25, -1.0]
    # L = 12 > L_max = 10 (the workers never produce it): DAPO's third case, -factor, not below.
    assert rows(overlong_penalty(torch.tensor([12]), 10, 4, 2.0)) == [-2.0]


def test_buffer_zero_is_a_no_op():
    lengths = torch.tensor([1, 5, 24])
    assert rows(overlong_penalty(lengths, None, 0, 1.0)) == [0.0, 0.0, 0.0]
    assert rows(overlong_penalty(lengths, 24, 0, 3.0)) == [0.0, 0.0, 0.0]
    scores = torch.tensor([0.5, -1.0, 2.0])
    truncated = torch.tensor([False, False, True])
    shaped, over = length_shaped_scores(scores, truncated, lengths, buffer=0, max_tokens=24)
    assert torch.equal(shaped, scores) and rows(over) == [0.0, 0.0, 0.0]
    # with missing_eos_penalty on and buffer 0: exactly missing_eos_penalty's result
    shaped, _ = length_shaped_scores(scores, truncated, lengths, eos_penalty=0.5, buffer=0)
    assert torch.equal(shaped, missing_eos_penalty(scores, truncated, 0.5))


def test_bad_arguments_of_the_pure_function_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        overlong_penalty(torch.tensor([3]), None, 2)
    with pytest.raises(ValueError, match="max_tokens"):
        overlong_penalty(torch.tensor([3]), 4, 5)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(torch.tensor([3]), 4, 2, 0.0)


def test_missing_eos_penalty_and_the_overlong_ramp_add():
    """score' = score - missing_eos_penalty * 1[truncated] + overlong(L); L_max = 10, B = 4, factor 1,
    missing_eos_penalty 0.5."""
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0])
    truncated = torch.tensor([False, False, False, True])
    lengths = torch.tensor([5, 9, 10, 10])
    shaped, over = length_shaped_scores(
        scores, truncated, lengths, eos_penalty=0.5, max_tokens=10, buffer=4, factor=1.0
    )
    assert rows(over) == [0.0, -0.75, -1.0, -1.0]
    assert rows(shaped) == [
        1.0,  # L = 5 before the ramp, EOS: untouched
        0.25,  # L = 9 with EOS: 1 + (6 - 9) / 4 = 1 - 0.75
        0.0,  # L = 10 ending with its EOS on the last allowed token: 1 - 1 (no missing-EOS penalty)
        -0.5,  # L = 10 truncated: 1 - 0.5 (missing EOS) - 1 (ramp end)
    ]
    # missing_eos_penalty off: only the ramp
    shaped, _ = length_shaped_scores(scores, truncated, lengths, max_tokens=10, buffer=4)
    assert rows(shaped) == [1.0, 0.25, 0.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 64).flatmap(
        lambda lmax: st.tuples(
            st.just(lmax),
            st.integers(1, lmax),
            st.lists(st.integers(1, lmax), min_size=1, max_size=8),
            st.floats(0.01, 5.0),
        )
    )
)
def test_the_ramp_is_monotone_bounded_and_zero_before_the_buffer(case):
    lmax, buffer, lengths, factor = case
    out = overlong_penalty(torch.tensor(lengths), lmax, buffer, factor)
    for length, p in zip(lengths, out.tolist(), strict=True):
        assert -factor - 1e-12 <= p <= 0.0
        if length <= lmax - buffer:
            assert p == 0.0
        assert p == pytest.approx(min(0.0, ((lmax - buffer) - length) / buffer * factor), abs=1e-12)
    full = overlong_penalty(torch.arange(1, lmax + 1), lmax, buffer, factor)
    assert bool((full[1:] <= full[:-1]).all())  # never rewards a longer response
    assert float(full[-1]) == pytest.approx(-factor)


# ---------------------------------------------------------------------------------- the filter's mask


def test_the_filter_mask_zeroes_exactly_the_truncated_rows():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    truncated = torch.tensor([False, True, False, True])
    got = overlong_filter_mask(mask, truncated)
    assert got.dtype == mask.dtype
    assert got.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert torch.equal(overlong_filter_mask(mask, torch.zeros(4, dtype=torch.bool)), mask)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda b: st.tuples(
            st.lists(st.integers(1, 5), min_size=b, max_size=b),
            st.lists(st.booleans(), min_size=b, max_size=b),
            st.integers(0, 2**31 - 1),
            st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
        )
    )
)
def test_filtered_rows_reach_neither_the_loss_nor_its_gradient(case):
    """Whatever a truncated row holds (even NaN) the filtered loss and its gradient are the same, and
    equal the loss of the kept rows alone; the truncated rows' gradient is exactly 0."""
    lengths, trunc, seed, agg = case
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()
    truncated = torch.tensor(trunc)
    keep = overlong_filter_mask(mask, truncated)
    old = torch.randn(B, T, generator=g) - 2
    adv = torch.randn(B, T, generator=g)

    def loss_of(lp, old_lp, advantages, m):
        lp = lp.clone().requires_grad_()
        loss, _ = policy_loss(lp, old_lp, advantages, m, agg=agg)
        (grad,) = torch.autograd.grad(loss, lp)
        return loss.detach(), grad

    lp = old + 0.1 * torch.randn(B, T, generator=g)
    base, grad = loss_of(lp, old, adv, keep)
    poisoned_lp, poisoned_adv = lp.clone(), adv.clone()
    poisoned_lp[truncated] = float("nan")
    poisoned_adv[truncated] = 1e6
    loss2, grad2 = loss_of(poisoned_lp, old, poisoned_adv, keep)
    assert torch.isfinite(base) and torch.equal(base, loss2) and torch.equal(grad, grad2)
    assert bool((grad[truncated] == 0).all()) and bool(torch.isfinite(grad).all())
    kept = ~truncated
    if kept.any():  # the kept rows on their own give the same loss
        alone, _ = loss_of(lp[kept], old[kept], adv[kept], mask[kept])
        torch.testing.assert_close(base, alone, rtol=1e-6, atol=1e-7)
    else:
        assert float(base) == 0.0


def test_every_sample_filtered_gives_a_zero_loss_and_no_nan():
    mask = torch.ones(3, 4)
    keep = overlong_filter_mask(mask, torch.ones(3, dtype=torch.bool))
    lp = torch.full((3, 4), float("nan"), requires_grad=True)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        # the minibatch's global counts are 0 as well
        loss, metrics = policy_loss(lp, torch.zeros(3, 4), torch.ones(3, 4), keep, agg=agg,
                                    global_tokens=0.0, global_seqs=0.0)  # fmt: skip
        (grad,) = torch.autograd.grad(loss, lp)
        assert float(loss.detach()) == 0.0 and bool((grad == 0).all())
        assert all(np.isfinite(v) for v in metrics.values())
        v = torch.zeros(3, 4, requires_grad=True)
        vf, _ = value_loss(v, torch.zeros(3, 4), torch.ones(3, 4), keep, 0.2, agg, 0.0, 0.0)
        assert float(vf.detach()) == 0.0
        assert float(aggregate_loss(torch.full((3, 4), float("nan")), keep, agg, 0.0, 0.0)) == 0.0


# ---------------------------------------------------------------------------------- in the learner


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    from tiny_models import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("overlong_lm"), "gpt2", seed=5)


def _trajectories(truncated: list[bool], max_new: int = 6, seed: int = 0, swap: int | None = None):
    """Two samples per prompt (score 1 for every third); a truncated one has exactly max_new tokens (the
    workers' contract), sample i otherwise 2 + i % 3 tokens. `swap`: that sample's response tokens
    replaced by other tokens (same length)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, cut in enumerate(truncated):
        r = max_new if cut else 2 + i % 3
        resp = rng.integers(4, VOCAB, size=r)
        if i == swap:
            resp = (resp - 4 + 7) % (VOCAB - 4) + 4
        out.append(
            Trajectory(
                rng.integers(4, VOCAB, size=3),
                resp,
                rng.normal(-3.3, 0.2, r).astype(np.float32),
                rng.normal(-3.3, 0.2, r).astype(np.float32),
                float(i % 3 == 0),
                group=i // 2,
                truncated=cut,
            )
        )
    return out


def _run(path, trajs, kl_coef: float = 0.1, **overrides):
    from learner.context import LearnerContext
    from learner.model import PolicyWithValueHead
    from learner.ppo_step import ppo_update
    from learner.prepare import prepare

    torch.manual_seed(0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(path), step_applied=True)
    config = LearnerConfig(
        **{"advantage": "grpo", "ppo_epochs": 1, "num_minibatches": 1, "micro_batch_size": 3, **overrides}
    )
    batch = pack_trajectories(trajs, pad_id=0)
    stats = prepare(LearnerContext(tap, config, 1.0, 0), batch, kl_coef)
    stats.update(ppo_update(LearnerContext(tap, config, 1.0, 0, torch.Generator().manual_seed(3)), batch))
    return tap.grads, stats, batch


def _same_grads(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def test_the_filter_takes_the_truncated_samples_out_of_the_gradient(policy_path):
    """grpo (each sample's advantage depends on its own tokens and the group's scores only): with the
    filter, changing a truncated sample's response tokens changes no gradient; without it, it does."""
    cut = [False, True, False, False, True, False]
    grads, stats, batch = _run(policy_path, _trajectories(cut), overlong={"filter": True})
    changed = _run(policy_path, _trajectories(cut, swap=1), overlong={"filter": True})[0]
    assert len(grads) == 1 and _same_grads(grads, changed)
    assert stats["train/overlong_filtered"] == 2.0
    # loss mask: rows 1 and 4 (truncated, 6 tokens) emptied; rows 0, 2, 3, 5 keep 2 + i % 3 tokens
    assert batch.mask.sum(1).tolist() == [2.0, 0.0, 4.0, 2.0, 0.0, 4.0]
    assert stats["train/tokens"] == 12.0 and stats["train/sequences"] == 6.0
    unfiltered, unfiltered_stats, _ = _run(policy_path, _trajectories(cut))
    unfiltered_changed = _run(policy_path, _trajectories(cut, swap=1))[0]
    assert not _same_grads(unfiltered, unfiltered_changed)  # the test can see a truncated sample's tokens
    assert "train/overlong_filtered" not in unfiltered_stats and unfiltered_stats["train/tokens"] == 24.0


def test_every_sample_filtered_takes_no_step_and_reports_a_zero_loss(policy_path):
    grads, stats, _ = _run(policy_path, _trajectories([True] * 4), overlong={"filter": True})
    assert grads == []  # no optimizer step on zero gradients
    assert stats["train/overlong_filtered"] == 4.0 and stats["train/tokens"] == 0.0
    assert stats["train/optimizer_steps"] == 0.0 and stats["train/skipped_steps"] == 0.0
    for key in ("loss/policy", "loss/value", "loss/entropy", "params/grad_norm", "params/approx_kl"):
        assert stats[key] == 0.0, key


def test_micro_batch_loss_of_an_all_filtered_micro_batch_is_zero_with_finite_gradients(policy_path):
    from learner.context import LearnerContext
    from learner.model import PolicyWithValueHead
    from learner.ppo_step import micro_batch_loss
    from learner.prepare import prepare

    torch.manual_seed(0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(policy_path, value_head_std=0.1), step_applied=True)
    for advantage in ("gae", "grpo"):
        config = LearnerConfig(advantage=advantage, overlong={"filter": True}, entropy_coef=0.01)
        batch = pack_trajectories(_trajectories([True, True]), pad_id=0)
        prepare(LearnerContext(tap, config, 1.0, 0), batch, 0.1)
        mb = batch.take(torch.arange(2))
        loss, _scored, local = micro_batch_loss(LearnerContext(tap, config, 1.0, 0), mb, 0.0, 0.0)
        assert float(loss.detach()) == 0.0 and all(np.isfinite(local.as_tensor().numpy()))
        tap.model.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in tap.model.parameters() if p.grad is not None)


def test_the_ramp_reaches_the_scores_the_learner_trains_on(policy_path):
    """grpo without std scaling: a_i = s'_i - mean of the group. Group 0: sample 0 (2 tokens, score 1)
    and sample 1 (truncated at L_max = 6, score 0). B = 4, ramp after 2 tokens: s'_1 = 0 - 0.5 (missing
    EOS) + (2 - 6) / 4 = -1.5; s'_0 = 1. Mean -0.25: advantages 1.25 and -1.25 (kl coef 0 here)."""
    cfg = {
        "missing_eos_penalty": 0.5,
        "overlong": {"buffer": 4, "max_tokens": 6},
        "grpo": {"norm_adv_by_std": False},
    }
    _, stats, batch = _run(policy_path, _trajectories([False, True]), kl_coef=0.0, **cfg)
    adv = batch.tokens.advantages
    assert float(adv[0, 0]) == pytest.approx(1.25) and float(adv[1, 0]) == pytest.approx(-1.25)
    assert stats["train/overlong_penalty_mean"] == pytest.approx(-0.5)  # (0 + -1) / 2 sequences
    assert stats["train/reward_mean"] == pytest.approx(0.5)  # the raw scores


def test_an_overlong_max_tokens_that_is_not_the_workers_limit_stops_the_step(policy_path):
    with pytest.raises(ValueError, match=r"learner\.overlong\.max_tokens=8"):
        _run(policy_path, _trajectories([False, True], max_new=6), overlong={"buffer": 2, "max_tokens": 8})
    with pytest.raises(ValueError, match=r"learner\.overlong\.max_tokens=5"):
        _run(policy_path, _trajectories([False, True], max_new=6), overlong={"buffer": 2, "max_tokens": 5})


# ---------------------------------------------------------------------------------- config


def test_defaults_are_off():
    c = LearnerConfig()
    o = c.overlong
    assert (o.buffer, o.penalty, o.max_tokens, o.filter) == (
        0,
        1.0,
        None,
        False,
    )
    for name in ("buffer", "penalty", "max_tokens", "filter"):
        assert OverlongConfig.model_fields[name].description


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"overlong": {"buffer": -1}}, "overlong.buffer"),
        ({"overlong": {"penalty": 0.0}}, "overlong.penalty"),
        ({"overlong": {"penalty": -1.0}}, "overlong.penalty"),
        ({"overlong": {"max_tokens": 0}}, "overlong.max_tokens"),
        ({"overlong": {"filter": "sometimes"}}, "overlong.filter"),
        ({"overlong": {"buffer": 9, "max_tokens": 8}}, "learner.overlong.buffer=9"),
    ],
)
def test_config_errors_name_the_field(fields, named):
    with pytest.raises(ValidationError) as info:
        LearnerConfig(**fields)
    assert named in str(info.value)


def test_run_config_errors_name_the_learner_field():
    from cluster.config.schema import ConfigError, build_config

    base = {"model": {"policy_path": "p"}, "data": {"prompts_path": "x.jsonl"}, "reward": {"model_path": "r"}}
    with pytest.raises(ConfigError, match=r"learner\.overlong\.buffer"):
        build_config({**base, "learner": {"overlong": {"buffer": -2}}})
    # L_max is the workers' limit: filled from it, any other value refused
    assert (
        build_config({**base, "learner": {"overlong": {"buffer": 2}}}).resolved.learner.overlong.max_tokens
        == 24
    )
    sampling = {"sampling": {"max_new_tokens": 16}}
    assert build_config({**base, "rollout": sampling}).resolved.overlong_max_tokens == 16
    with pytest.raises(ConfigError, match=r"learner\.overlong\.max_tokens=20 differs from rollout\.sampling"):
        build_config({**base, "learner": {"overlong": {"max_tokens": 20}}})
    with pytest.raises(ConfigError, match=r"learner\.overlong\.buffer=20 must be <="):
        build_config({**base, "rollout": sampling, "learner": {"overlong": {"buffer": 20}}})
    learner = {"overlong": {"buffer": 2, "max_tokens": 24, "filter": True}}
    cfg = build_config({**base, "learner": learner})
    assert cfg.learner.overlong.buffer == 2 and cfg.learner.overlong.filter
