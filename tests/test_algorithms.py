"""The PPO math, checked against hand-worked numbers and a naive independent reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.algorithms import (
    LOG_RATIO_CLAMP,
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    shape_rewards,
)
from learner.losses import aggregate_loss, policy_loss, value_loss

T = torch.tensor


def assert_rows(x: torch.Tensor, expected: list[list[float]], atol: float = 1e-6) -> None:
    torch.testing.assert_close(x.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def mask_from_lengths(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


# ----------------------------------------------------------------------------- GAE, by hand


def test_gae_seed_three_step_example():
    # The 3-step example of the GAE seed: gamma 0.9, lambda 0.95, V = 2.0, 2.5, 3.0, r = 1, 0, 2.
    rewards = T([[1.0, 0.0, 2.0]])
    values = T([[2.0, 2.5, 3.0]])
    adv, ret = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.95)
    # delta_2 = 2 - 3 = -1;  A_1 = 0.2 + 0.855 * -1 = -0.655;  A_0 = 1.25 + 0.855 * -0.655 = 0.689975
    assert adv[0].tolist() == pytest.approx([0.689975, -0.655, -1.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([2.689975, 1.845, 2.0], abs=1e-6)


def test_gae_lambda_one_is_monte_carlo_return_minus_value():
    rewards = T([[0.5, -1.0, 0.0, 2.0]])
    values = T([[0.3, 0.1, -0.2, 0.4]])
    gamma = 0.9
    adv, ret = compute_gae(rewards, values, torch.ones(1, 4), gamma=gamma, lam=1.0)
    mc = [sum(gamma**k * rewards[0, t + k].item() for k in range(4 - t)) for t in range(4)]
    assert adv[0].tolist() == pytest.approx([mc[t] - values[0, t].item() for t in range(4)], abs=1e-6)
    assert ret[0].tolist() == pytest.approx(mc, abs=1e-6)


def test_gae_lambda_zero_is_one_step_td_error():
    rewards = T([[0.5, -1.0, 2.0]])
    values = T([[0.3, 0.1, -0.2]])
    adv, _ = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.8, lam=0.0)
    expected = [0.5 + 0.8 * 0.1 - 0.3, -1.0 + 0.8 * -0.2 - 0.1, 2.0 + 0.0 - (-0.2)]
    assert adv[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_gae_value_after_last_valid_token_is_zero_and_padding_ignored():
    # Row of 2 valid tokens: the value at the (padded) 3rd position must not bootstrap.
    rewards = T([[1.0, 1.0, 99.0]])
    values = T([[0.5, 0.5, 123.0]])
    mask = T([[1.0, 1.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([1.5, 0.5, 0.0])
    assert ret[0].tolist() == pytest.approx([2.0, 1.0, 0.0])


def naive_gae(rewards, values, length, gamma, lam):
    """Independent reference: per row, explicit sums of discounted TD errors."""
    deltas = []
    for t in range(length):
        v_next = values[t + 1] if t + 1 < length else 0.0
        deltas.append(rewards[t] + gamma * v_next - values[t])
    adv = [sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t)) for t in range(length)]
    return adv, [a + values[t] for t, a in enumerate(adv)]


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    B=st.integers(1, 4),
    width=st.integers(1, 7),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_matches_naive_reference(data, B, width, gamma, lam):
    lengths = data.draw(st.lists(st.integers(0, width), min_size=B, max_size=B))
    floats = st.floats(-5, 5, allow_nan=False)
    rewards = T(data.draw(st.lists(st.lists(floats, min_size=width, max_size=width), min_size=B, max_size=B)))
    values = T(data.draw(st.lists(st.lists(floats, min_size=width, max_size=width), min_size=B, max_size=B)))
    mask = mask_from_lengths(lengths, width)
    adv, ret = compute_gae(rewards.double(), values.double(), mask, gamma, lam)
    for b, n in enumerate(lengths):
        ref_adv, ref_ret = naive_gae(rewards[b].double().tolist(), values[b].double().tolist(), n, gamma, lam)
        assert adv[b, :n].tolist() == pytest.approx(ref_adv, abs=1e-9)
        assert ret[b, :n].tolist() == pytest.approx(ref_ret, abs=1e-9)
        assert adv[b, n:].abs().sum() == 0 and ret[b, n:].abs().sum() == 0


# ----------------------------------------------------------------------------- KL and rewards


def test_kl_estimators_by_hand():
    lp, ref = T([0.0, -1.0]), T([-0.5, -0.5])  # d = 0.5, -0.5
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([0.5, -0.5])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.125])
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx(
        [math.exp(-0.5) - 1 + 0.5, math.exp(0.5) - 1 - 0.5], rel=1e-6
    )
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(lp, ref, "k4")


def test_k3_in_the_reward_is_clamped_like_the_loss():
    """d = log pi - log pi_ref = -100: exp(100) overflows float32 (inf); with d clamped to -20 the
    penalty is exp(20) - 1 - 20, finite, and the other side (d = +100 -> 20) is exp(-20) - 1 + 20."""
    lp, ref = T([-100.0, 0.0, -1.0]), T([0.0, -100.0, -1.0])
    k3 = kl_penalty(lp, ref, "k3")
    assert torch.isfinite(k3).all()
    c = LOG_RATIO_CLAMP
    assert k3.tolist() == pytest.approx([math.exp(c) - 1 - c, math.exp(-c) - 1 + c, 0.0], rel=1e-6)
    assert torch.isinf(torch.expm1(-(lp - ref))).any()  # what the unclamped formula gave


def test_seq_mean_counts_only_sequences_with_a_valid_token():
    """Rows [1, 2, pad] and [3, pad, pad] plus an empty row: seq-mean-token-mean = (1.5 + 3) / 2 and
    seq-mean-token-sum = (3 + 3) / 2; the empty row is not a sequence (it used to divide by 3)."""
    loss = T([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert float(aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx(2.25)
    assert float(aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx(3.0)
    assert float(aggregate_loss(loss, mask, "token-mean")) == pytest.approx(2.0)
    assert float(aggregate_loss(loss[2:], mask[2:], "seq-mean-token-mean")) == 0.0  # nothing valid


def test_k3_is_unbiased_for_kl_between_two_categoricals():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    q = torch.softmax(torch.randn(6), 0)
    exact = float((p * (p.log() - q.log())).sum())
    idx = torch.multinomial(p, 400_000, replacement=True)
    est = kl_penalty(p.log()[idx], q.log()[idx], "k3").mean()
    assert float(est) == pytest.approx(exact, abs=0.01)
    assert float(kl_penalty(p.log()[idx], q.log()[idx], "k1").mean()) == pytest.approx(exact, abs=0.01)


def test_shape_rewards_places_score_on_each_rows_last_valid_token():
    logprobs = T([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    ref = T([[-1.5, -1.0, -0.5, 7.0], [-2.5, 9.0, 9.0, 9.0]])
    mask = mask_from_lengths([3, 1], 4)
    rewards, kl = shape_rewards(T([10.0, 20.0]), logprobs, ref, mask, kl_coef=0.1)
    # kl = d = [0.5, 0, -0.5, pad] and [0.5, pad, pad, pad]
    assert_rows(kl, [[0.5, 0.0, -0.5, 0.0], [0.5, 0.0, 0.0, 0.0]])
    assert_rows(rewards, [[-0.05, 0.0, 0.05 + 10.0, 0.0], [-0.05 + 20.0, 0.0, 0.0, 0.0]])


def test_shape_rewards_row_without_valid_tokens_gets_nothing():
    rewards, kl = shape_rewards(T([5.0]), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), 0.1)
    assert rewards.abs().sum() == 0 and kl.abs().sum() == 0


# ----------------------------------------------------------------------------- statistics


def test_masked_mean_var_whiten_by_hand():
    x = T([[1.0, 2.0, 100.0], [3.0, float("nan"), float("nan")]])
    mask = mask_from_lengths([2, 1], 3)
    assert float(masked_mean(x, mask)) == pytest.approx(2.0)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 3.0])
    assert float(masked_var(x, mask)) == pytest.approx(1.0)  # unbiased: ((1)+(0)+(1)) / 2
    assert float(masked_var(x, mask, unbiased=False)) == pytest.approx(2 / 3)
    w = masked_whiten(x, mask)
    assert_rows(w, [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    w_keep = masked_whiten(x, mask, shift_mean=False)
    assert_rows(w_keep, [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])


@settings(max_examples=50, deadline=None)
@given(data=st.data(), B=st.integers(1, 4), width=st.integers(2, 8))
def test_whitening_gives_mean_zero_variance_one(data, B, width):
    lengths = data.draw(st.lists(st.integers(1, width), min_size=B, max_size=B))
    mask = mask_from_lengths(lengths, width)
    if mask.sum() < 3:
        return
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    scale, shift = data.draw(st.floats(0.1, 10)), data.draw(st.floats(-5, 5))
    x = torch.randn(B, width, dtype=torch.float64, generator=gen) * scale + shift
    w = masked_whiten(x, mask)
    var_x = float(masked_var(x, mask))
    assert float(masked_mean(w, mask)) == pytest.approx(0.0, abs=1e-6)
    # whitening divides by sqrt(var + 1e-8): exactly 1 up to that epsilon
    assert float(masked_var(w, mask)) == pytest.approx(var_x / (var_x + 1e-8), rel=1e-9)
    assert w[mask == 0].abs().sum() == 0


# ----------------------------------------------------------------------------- losses, by hand


def test_policy_loss_clipping_for_positive_and_negative_advantages():
    ratios = T([[1.5, 1.5, 0.5, 0.5]])
    adv = T([[1.0, -1.0, -1.0, 1.0]])
    loss, m = policy_loss(ratios.log(), torch.zeros(1, 4), adv, torch.ones(1, 4), clip_eps=0.2)
    # per token: A>0,r=1.5 -> -1.2 (clipped); A<0,r=1.5 -> 1.5; A<0,r=0.5 -> 0.8 (clipped); A>0,r=0.5 -> -0.5
    assert float(loss) == pytest.approx((-1.2 + 1.5 + 0.8 - 0.5) / 4)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["approx_kl"] == pytest.approx(0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4)


def test_policy_loss_asymmetric_clip():
    loss, _ = policy_loss(
        T([[math.log(1.5)]]), T([[0.0]]), T([[1.0]]), T([[1.0]]), clip_eps=0.2, clip_eps_high=0.28
    )
    assert float(loss) == pytest.approx(-1.28)


def test_policy_loss_dual_clip_caps_negative_advantages():
    ratios = T([[5.0, 2.0, 5.0]])
    adv = T([[-1.0, -1.0, 1.0]])
    loss, _ = policy_loss(ratios.log(), torch.zeros(1, 3), adv, torch.ones(1, 3), clip_eps=0.2, dual_clip=3.0)
    # A<0, r=5: max(5, 1.2) = 5, capped at -3*A = 3;  A<0, r=2: 2 (< 3);  A>0, r=5: -1.2 (untouched)
    assert float(loss) == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(ratios.log(), torch.zeros(1, 3), adv, torch.ones(1, 3), dual_clip=1.0)


def test_policy_loss_is_weights_and_aggregations():
    lp = torch.zeros(2, 3)
    adv = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = mask_from_lengths([3, 1], 3)
    w = T([[1.0, 0.5, 2.0], [1.0, 1.0, 1.0]])
    # ratio 1 -> per-token loss = -A * w = [-1, -1, -6], [-4]
    assert float(policy_loss(lp, lp, adv, mask, is_weights=w)[0]) == pytest.approx(-12 / 4)
    assert float(policy_loss(lp, lp, adv, mask, is_weights=w, agg="seq-mean-token-mean")[0]) == pytest.approx(
        (-8 / 3 - 4) / 2
    )
    assert float(policy_loss(lp, lp, adv, mask, is_weights=w, agg="seq-mean-token-sum")[0]) == pytest.approx(
        (-8 - 4) / 2
    )
    assert float(policy_loss(lp, lp, adv, mask, is_weights=w, global_tokens=8)[0]) == pytest.approx(-12 / 8)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(lp, lp, adv, mask, agg="sum")


def test_value_loss_by_hand():
    values, old, ret = T([[1.5, 1.1]]), T([[1.0, 1.0]]), T([[2.0, 0.0]])
    loss, m = value_loss(values, old, ret, torch.ones(1, 2), clip_eps=0.2)
    # token 0: clipped V = 1.2 -> max(0.25, 0.64) = 0.64 (clipped);  token 1: V within clip -> 1.21
    assert float(loss) == pytest.approx((0.5 * 0.64 + 0.5 * 1.21) / 2)
    assert m["clip_frac"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- masking invariance


@settings(max_examples=40, deadline=None)
@given(data=st.data(), B=st.integers(1, 3), width=st.integers(1, 6))
def test_padding_content_changes_no_output(data, B, width):
    lengths = data.draw(st.lists(st.integers(0, width), min_size=B, max_size=B))
    mask = mask_from_lengths(lengths, width)
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    base = {k: torch.randn(B, width) for k in ("lp", "old", "ref", "v", "vold", "adv", "r")}
    garbage = {k: torch.where(mask.bool(), x, torch.full_like(x, float("nan"))) for k, x in base.items()}
    scores = torch.randn(B)

    def outputs(t):
        rewards, kl = shape_rewards(scores, t["lp"], t["ref"], mask, 0.1, "k3")
        adv, ret = compute_gae(rewards, t["v"], mask, 0.99, 0.95)
        pl, pm = policy_loss(t["lp"], t["old"], t["adv"], mask, dual_clip=3.0)
        vl, vm = value_loss(t["v"], t["vold"], t["r"], mask)
        w = masked_whiten(t["adv"], mask)
        return [rewards, kl, adv, ret, pl, vl, w, T(list(pm.values())), T(list(vm.values()))]

    for a, b in zip(outputs(base), outputs(garbage), strict=False):
        assert torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0))
        assert not torch.isnan(b).any()


# ----------------------------------------------------------------------------- micro-batching


@pytest.mark.parametrize("splits", [[2, 2], [1, 3], [3, 1], [1, 1, 2]])
def test_micro_batches_with_global_tokens_equal_the_whole_batch(splits):
    torch.manual_seed(1)
    B, width = 4, 5
    mask = mask_from_lengths([5, 2, 4, 1], width)
    old = torch.randn(B, width)
    adv = torch.randn(B, width)
    vold, ret = torch.randn(B, width), torch.randn(B, width)
    lp_full = (old + 0.3 * torch.randn(B, width)).requires_grad_()
    v_full = (vold + 0.3 * torch.randn(B, width)).requires_grad_()

    def total(lp, v, rows, global_tokens):
        pl, _ = policy_loss(lp[rows], old[rows], adv[rows], mask[rows], global_tokens=global_tokens)
        vl, _ = value_loss(v[rows], vold[rows], ret[rows], mask[rows], global_tokens=global_tokens)
        return pl + 0.5 * vl

    whole = total(lp_full, v_full, slice(None), None)
    g_whole = torch.autograd.grad(whole, [lp_full, v_full])

    n_tokens = float(mask.sum())
    parts, grads = [], [torch.zeros_like(lp_full), torch.zeros_like(v_full)]
    start = 0
    for size in splits:
        rows = slice(start, start + size)
        start += size
        part = total(lp_full, v_full, rows, n_tokens)
        parts.append(float(part.detach()))
        for acc, g in zip(grads, torch.autograd.grad(part, [lp_full, v_full]), strict=False):
            acc += g
    assert sum(parts) == pytest.approx(float(whole.detach()), abs=1e-6)
    for g_sum, g_ref in zip(grads, g_whole, strict=False):
        assert torch.allclose(g_sum, g_ref, atol=1e-7)


# ----------------------------------------------------------------------------- logits helpers


def test_logprobs_and_entropy_from_logits():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 11) * 5
    tokens = torch.randint(0, 11, (2, 3))
    ref = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs_from_logits(logits, tokens), ref, atol=1e-6)
    bf16 = logprobs_from_logits(logits.bfloat16(), tokens)
    assert bf16.dtype == torch.float32 and torch.allclose(bf16, ref, atol=0.1)
    p = torch.softmax(logits, -1)
    assert torch.allclose(entropy_from_logits(logits), -(p * p.log()).sum(-1), atol=1e-5)
    assert float(entropy_from_logits(torch.zeros(7))) == pytest.approx(math.log(7))
    huge = T([[1e4, 0.0, -1e4]])
    assert torch.isfinite(logprobs_from_logits(huge, T([2]))).all()
    assert torch.isfinite(entropy_from_logits(huge)).all()


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_moves_coefficient_the_right_way():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=256)  # error = clip(0.5) = 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    up = ctl.value
    ctl.update(6.6, n_steps=100)  # error = 0.1
    assert ctl.value == pytest.approx(up * (1 + 0.1 * 100 / 10000))
    before = ctl.value
    ctl.update(0.0, n_steps=500)  # error = clip(-1) = -0.2
    assert ctl.value == pytest.approx(before * (1 - 0.2 * 500 / 10000))
    state = ctl.state_dict()
    other = AdaptiveKLController(1.0, target=1.0, horizon=1)
    other.load_state_dict(state)
    assert other.value == ctl.value and other.target == 6.0 and other.horizon == 10000


def test_fixed_kl_controller_is_constant():
    ctl = FixedKLController(0.2)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.2
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.2
