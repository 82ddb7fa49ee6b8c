"""The advantage estimators (learner.advantages), KL loss, missing-EOS penalty and truncation
bootstrap: hand-worked numbers and hypothesis properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.records.groups import group_runs, shard_by_group
from learner.advantages import (
    AdvantageInputs,
    AdvantageParams,
    estimate,
    grpo_advantages,
    kl_loss,
    missing_eos_penalty,
    needs_critic,
    returns_to_go,
    rloo_advantages,
    vtrace,
)
from learner.algorithms import compute_gae, shape_rewards

T = torch.tensor


def estimate_with(estimator, *, gamma, lam, group_std=True, **inputs):
    """`estimate` with the inputs and settings as keywords."""
    return estimate(estimator, AdvantageInputs(**inputs), AdvantageParams(gamma, lam, group_std))


def assert_rows(x: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(x.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def mask_from_lengths(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


# ----------------------------------------------------------------------------- group baselines, by hand


def test_grpo_group_mean_and_std_by_hand():
    scores, groups = T([1.0, 3.0, 5.0, 10.0, 10.0, 7.0]), T([0, 0, 0, 1, 1, 2])
    # group 0: mean 3, std sqrt((4 + 0 + 4) / 2) = 2; group 1: std 0; group 2: one sample.
    assert_rows(grpo_advantages(scores, groups, std_normalize=False), [-2, 0, 2, 0, 0, 0])
    assert_rows(grpo_advantages(scores, groups, std_normalize=True), [-1, 0, 1, 0, 0, 0], atol=1e-5)


def test_rloo_leave_one_out_by_hand():
    scores, groups = T([1.0, 3.0, 5.0, 10.0, 10.0, 7.0]), T([4, 4, 4, 9, 9, 2])
    # 1 - (3+5)/2 = -3, 3 - (1+5)/2 = 0, 5 - (1+3)/2 = 3; 10 - 10 = 0; a group of one has no baseline.
    assert_rows(rloo_advantages(scores, groups), [-3, 0, 3, 0, 0, 0])


def test_group_outcome_broadcast_plus_kl_return_to_go_by_hand():
    # Two samples of one prompt, scores 2 and 0 (rloo: +2, -2); per-token KL penalty 0.5 * kl in reward.
    mask = mask_from_lengths([2, 1], 2)
    logp, ref = T([[0.1, 0.2], [0.3, 9.0]]), T([[0.0, 0.0], [0.0, 0.0]])
    scores = T([2.0, 0.0])
    rewards, _ = shape_rewards(scores, logp, ref, mask, kl_coef=0.5)
    adv, returns = estimate_with(
        "rloo",
        scores=scores,
        rewards=rewards,
        values=torch.zeros(2, 2),
        mask=mask,
        gamma=1.0,
        lam=0.95,
        groups=T([0, 0]),
    )
    # row 0: 2 + (-0.05 - 0.1) = 1.85, 2 - 0.1 = 1.9; row 1: -2 - 0.15 = -2.15, padding 0.
    assert_rows(adv, [[1.85, 1.9], [-2.15, 0.0]])
    assert_rows(returns, [[0, 0], [0, 0]])
    # kl.mode='loss': beta 0 in the reward, so the outcome advantage is broadcast unchanged.
    rewards0, _ = shape_rewards(scores, logp, ref, mask, kl_coef=0.0)
    adv0, _ = estimate_with(
        "grpo",
        scores=scores,
        rewards=rewards0,
        values=torch.zeros(2, 2),
        mask=mask,
        gamma=1.0,
        lam=0.95,
        groups=T([0, 0]),
        group_std=False,
    )
    assert_rows(adv0, [[1.0, 1.0], [-1.0, 0.0]])


def test_reinforce_pp_whitened_returns_by_hand():
    mask = mask_from_lengths([2, 1], 2)
    rewards = T([[0.0, 1.0], [-1.0, 0.0]])
    adv, _ = estimate_with(
        "reinforce_pp",
        scores=T([1.0, -1.0]),
        rewards=rewards,
        values=torch.zeros(2, 2),
        mask=mask,
        gamma=1.0,
        lam=0.95,
    )
    # returns-to-go [1, 1] and [-1]: mean 1/3, unbiased var ((2/3)^2 * 2 + (4/3)^2) / 2 = 4/3.
    s = math.sqrt(4 / 3)
    assert_rows(adv, [[(2 / 3) / s, (2 / 3) / s], [-(4 / 3) / s, 0.0]], atol=1e-5)
    assert_rows(returns_to_go(T([[1.0, 2.0, 3.0]]), torch.ones(1, 3), 0.5), [[1 + 1 + 0.75, 2 + 1.5, 3]])


def test_critic_registry():
    assert needs_critic("gae") and needs_critic("vtrace")
    assert not any(needs_critic(e) for e in ("grpo", "rloo", "reinforce_pp"))
    with pytest.raises(
        ValueError, match=r"advantage estimator 'ppo' \(learner.advantage\); allowed: gae, grpo, rloo"
    ):
        needs_critic("ppo")


# ----------------------------------------------------------------------------- V-trace, by hand


def _vtrace_example(**kw):
    rewards, values = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.4, 0.8]])
    log_rho = torch.log(T([[2.0, 0.5, 1.0]]))  # pi / mu per token
    return vtrace(rewards, values, log_rho, torch.ones(1, 3), gamma=1.0, **kw)


def test_vtrace_three_tokens_by_hand():
    # rho = c = [1, 0.5, 1]; delta = [1*(0+0.4-0.5), 0.5*(0+0.8-0.4), 1*(1+0-0.8)] = [-0.1, 0.2, 0.2]
    # v2 = 0.8+0.2 = 1.0; v1 = 0.4 + 0.2 + 0.5*0.2 = 0.7; v0 = 0.5 - 0.1 + 1*0.3 = 0.7
    # A = rho * (r + v_next - V) = [0.7-0.5, 0.5*(1.0-0.4), 1-0.8] = [0.2, 0.3, 0.2]
    adv, vs = _vtrace_example(lam=1.0, rho_clip=1.0, c_clip=1.0)
    assert_rows(vs, [[0.7, 0.7, 1.0]])
    assert_rows(adv, [[0.2, 0.3, 0.2]])
    # rho_clip 2 > c_clip 1: rho0 = 2, so delta0 = -0.2, v0 = 0.5 - 0.2 + 0.3 = 0.6, A0 = 2 * (0.7 - 0.5).
    adv, vs = _vtrace_example(lam=1.0, rho_clip=2.0, c_clip=1.0)
    assert_rows(vs, [[0.6, 0.7, 1.0]])
    assert_rows(adv, [[0.4, 0.3, 0.2]])
    # Truncated, bootstrapped from V = 0.5 after the last token: delta2 = 1 + 0.5 - 0.8 = 0.7, v2 = 1.5,
    # v1 = 0.4 + 0.2 + 0.5*0.7 = 0.95, v0 = 0.5 - 0.1 + 0.55 = 0.95; A = [0.45, 0.5*1.1, 0.7].
    adv, vs = _vtrace_example(lam=1.0, bootstrap=T([0.5]))
    assert_rows(vs, [[0.95, 0.95, 1.5]])
    assert_rows(adv, [[0.45, 0.55, 0.7]])


def _batch(data, B: int, width: int):
    lengths = data.draw(st.lists(st.integers(0, width), min_size=B, max_size=B))
    mask = mask_from_lengths(lengths, width)

    def mat(lo=-3.0, hi=3.0):
        vals = data.draw(
            st.lists(st.floats(lo, hi, allow_nan=False, width=32), min_size=B * width, max_size=B * width)
        )
        return torch.tensor(vals, dtype=torch.float32).reshape(B, width)

    return mask, mat


@settings(max_examples=60, deadline=None)
@given(data=st.data(), B=st.integers(1, 4), width=st.integers(1, 7), gamma=st.floats(0.5, 1.0))
def test_vtrace_on_policy_is_gae_lambda_one(data, B, width, gamma):
    """pi = mu and rho_clip = c_clip = 1: targets are Monte-Carlo returns, advantages GAE(lambda=1)."""
    mask, mat = _batch(data, B, width)
    rewards, values = mat(), mat()
    boot = torch.tensor(data.draw(st.lists(st.floats(-2, 2, width=32), min_size=B, max_size=B)))
    adv, vs = vtrace(rewards, values, torch.zeros(B, width), mask, gamma, 1.0, 1.0, 1.0, boot)
    gae_adv, gae_ret = compute_gae(rewards, values, mask, gamma, 1.0, bootstrap=boot)
    torch.testing.assert_close(adv, gae_adv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vs, gae_ret, atol=1e-4, rtol=1e-4)
    mc = returns_to_go(rewards, mask, gamma) + _discounted_bootstrap(boot, mask, gamma)
    torch.testing.assert_close(vs, mc, atol=1e-4, rtol=1e-4)
    # Any lambda: the targets are GAE(lambda) returns.
    lam = data.draw(st.floats(0.0, 1.0))
    _, vs_lam = vtrace(rewards, values, torch.zeros(B, width), mask, gamma, lam, 1.0, 1.0)
    torch.testing.assert_close(
        vs_lam, compute_gae(rewards, values, mask, gamma, lam)[1], atol=1e-4, rtol=1e-4
    )


def _discounted_bootstrap(boot, mask, gamma):
    """gamma^(n - t) * bootstrap on each valid token t of a row with n valid tokens."""
    n = mask.sum(-1, keepdim=True)
    t = torch.arange(mask.shape[1]).unsqueeze(0)
    return torch.where(mask.bool(), gamma ** (n - t) * boot.unsqueeze(-1), torch.zeros(()))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), B=st.integers(1, 3), width=st.integers(1, 6))
def test_vtrace_ignores_padding(data, B, width):
    mask, mat = _batch(data, B, width)
    rewards, values, log_rho = mat(), mat(), mat(-1.0, 1.0)
    junk = torch.where(mask.bool(), torch.zeros(()), torch.full((), float("nan")))
    a1, v1 = vtrace(rewards, values, log_rho, mask, 0.9, 0.9, 1.5, 1.0)
    a2, v2 = vtrace(rewards + junk, values + junk, log_rho + junk, mask, 0.9, 0.9, 1.5, 1.0)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(v1, v2)
    assert torch.all(a1[~mask.bool()] == 0) and torch.all(v1[~mask.bool()] == 0)


# ----------------------------------------------------------------------------- truncation and EOS, by hand


def test_gae_bootstrap_at_truncation_by_hand():
    rewards, values, mask = T([[0.0, 1.0]]), T([[0.5, 0.2]]), torch.ones(1, 2)
    # terminal: delta1 = 1 - 0.2 = 0.8, A0 = (0 + 0.2 - 0.5) + 0.5 * 0.8 = 0.1
    adv, ret = compute_gae(rewards, values, mask, 1.0, 0.5)
    assert_rows(adv, [[0.1, 0.8]])
    # bootstrap V = 0.3 at the cut: delta1 = 1 + 0.3 - 0.2 = 1.1, A0 = -0.3 + 0.5 * 1.1 = 0.25
    adv, ret = compute_gae(rewards, values, mask, 1.0, 0.5, bootstrap=T([0.3]))
    assert_rows(adv, [[0.25, 1.1]])
    assert_rows(ret, [[0.75, 1.3]])
    # a zero bootstrap is the terminal case, bit for bit
    padded = mask_from_lengths([2, 1], 2)
    r2, v2 = T([[0.0, 1.0], [2.0, 0.0]]), T([[0.5, 0.2], [0.1, 0.0]])
    a, b = (
        compute_gae(r2, v2, padded, 0.9, 0.8),
        compute_gae(r2, v2, padded, 0.9, 0.8, bootstrap=torch.zeros(2)),
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_missing_eos_penalty_by_hand():
    scores, truncated = T([1.0, 2.0, -1.0]), T([False, True, True])
    assert_rows(missing_eos_penalty(scores, truncated, 0.5), [1.0, 1.5, -1.5])
    assert missing_eos_penalty(scores, truncated, None) is scores


# ----------------------------------------------------------------------------- KL as a loss term


def test_k3_loss_value_and_gradient_direction_by_hand():
    # token 0: pi = 0.5, pi_ref = 0.25 (d = ln 2): k3 = 0.5 - 1 + ln 2, d k3 / d log pi = 1 - 0.5 = 0.5 > 0
    # token 1: pi = 0.25, pi_ref = 0.5 (d = -ln 2): k3 = 2 - 1 - ln 2, gradient 1 - 2 = -1 < 0
    # token 2: pi = pi_ref: 0 with gradient 0
    logp = torch.log(T([0.5, 0.25, 0.3])).requires_grad_(True)
    ref = torch.log(T([0.25, 0.5, 0.3]))
    k3 = kl_loss(logp, ref, "k3")
    assert_rows(k3.detach(), [math.log(2) - 0.5, 1 - math.log(2), 0.0])
    k3.sum().backward()
    assert_rows(logp.grad, [0.5, -1.0, 0.0])
    # so a descent step moves log pi towards log pi_ref on both sides
    assert_rows(kl_loss(T([0.3]), T([0.1]), "k2"), [0.02])


def test_k3_loss_descent_moves_policy_towards_reference():
    torch.manual_seed(0)
    z = torch.randn(6, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6), -1)
    tokens = torch.arange(6)
    for _ in range(200):
        logp = torch.log_softmax(z, -1)
        p = logp.exp().detach()  # expectation over tokens sampled from pi (exact here)
        loss = (p * kl_loss(logp[tokens], ref[tokens], "k3")).sum()
        z.grad = None
        loss.backward()
        with torch.no_grad():
            z -= 0.5 * z.grad
    with torch.no_grad():
        kl = (torch.softmax(z, -1) * (torch.log_softmax(z, -1) - ref)).sum()
    assert float(kl) < 1e-3


# ----------------------------------------------------------------------------- groups across ranks


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=12),
    ranks=st.integers(1, 4),
    data=st.data(),
)
def test_groups_land_whole_and_baselines_match_one_process(sizes, ranks, data):
    keys = [(0, g) for g, n in enumerate(sizes) for _ in range(n)]
    groups = group_runs(keys)
    shards = shard_by_group(groups, ranks)
    assert len(shards) == ranks
    assert np.array_equal(np.concatenate(shards), np.arange(len(groups)))
    owner = {}
    for r, idx in enumerate(shards):
        for k in idx:
            assert owner.setdefault(groups[k], r) == r  # a group never straddles two ranks
    scores = torch.tensor(
        data.draw(st.lists(st.floats(-5, 5, width=32), min_size=len(groups), max_size=len(groups)))
    )
    g = torch.tensor(groups)
    for group_advantages in (grpo_advantages, rloo_advantages):
        whole = group_advantages(scores, g)
        pieces = torch.cat([group_advantages(scores[idx], g[idx]) for idx in shards if len(idx)])
        torch.testing.assert_close(pieces, whole)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 30), ranks=st.integers(1, 5))
def test_one_sample_per_prompt_shards_like_array_split(n, ranks):
    shards = shard_by_group(list(range(n)), ranks)
    expected = np.array_split(np.arange(n), ranks)
    assert [s.tolist() for s in shards] == [e.tolist() for e in expected]


def test_group_runs_by_hand():
    assert group_runs([(0, 5), (0, 5), (0, 7), (1, 7), (1, 7)]) == [0, 0, 1, 2, 2]
    assert shard_by_group([0, 0, 0, 1, 1, 1, 2, 2, 2], 2)[0].tolist() == [0, 1, 2, 3, 4, 5]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 6), G=st.integers(1, 4))
def test_group_baseline_properties(data, n, G):
    scores = torch.tensor(data.draw(st.lists(st.floats(-5, 5, width=32), min_size=n * G, max_size=n * G)))
    groups = torch.arange(G).repeat_interleave(n)
    centred = grpo_advantages(scores, groups, std_normalize=False)
    rloo = rloo_advantages(scores, groups)
    for g in range(G):
        sel = groups == g
        assert abs(float(centred[sel].sum())) < 1e-3 and abs(float(rloo[sel].sum())) < 1e-3
    if n > 1:  # RLOO is the centred score scaled by n / (n - 1)
        torch.testing.assert_close(rloo, centred * n / (n - 1), atol=1e-4, rtol=1e-4)
    perm = torch.randperm(n * G, generator=torch.Generator().manual_seed(n * 10 + G))
    torch.testing.assert_close(
        grpo_advantages(scores[perm], groups[perm]), grpo_advantages(scores, groups)[perm]
    )


# ----------------------------------------------------------------------------- config


def test_config_refuses_combinations_that_cannot_work():
    from cluster.config.schema import ConfigError, build_config
    from learner.config import LearnerConfig

    tree = {"model": {"policy_path": "p"}, "data": {"prompts_path": "x.jsonl"}, "reward": {"model_path": "r"}}
    assert build_config(tree).learner.advantage == "gae"  # the default
    with pytest.raises(ConfigError, match="learner.advantage"):
        build_config({**tree, "learner": {"advantage": "ppo"}})
    with pytest.raises(ConfigError, match="rollout.sampling.n >= 2"):
        build_config({**tree, "learner": {"advantage": "grpo"}})
    ok = build_config({**tree, "learner": {"advantage": "rloo"}, "rollout": {"sampling": {"n": 4}}})
    assert ok.learner.advantage == "rloo"
    # vtrace on stale samples: its own importance weights are the correction ('auto' resolves to none)
    stale = {"pipeline": {"mode": "async", "max_staleness": 2}}
    assert build_config({**tree, **stale, "learner": {"advantage": "vtrace"}}).resolved.off_policy == "none"
    with pytest.raises(ValueError, match="correct twice"):
        LearnerConfig(advantage="vtrace", off_policy="tis")
    with pytest.raises(ValueError, match="needs a critic"):
        LearnerConfig(advantage="grpo", truncation="bootstrap")
    with pytest.raises(ValueError, match="vtrace.c_clip"):
        LearnerConfig(advantage="vtrace", vtrace={"rho_clip": 1.0, "c_clip": 2.0})
    with pytest.raises(ValueError, match="kl.mode='reward'"):
        LearnerConfig(kl={"mode": "loss", "adaptive": True})
