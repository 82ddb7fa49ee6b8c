"""A critic that can move: running reward moments (Chan merge), score normalisation, value-clip modes.

Hand-worked numbers and numpy on the concatenated data as the independent reference.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.config import LearnerConfig
from learner.critic import (
    RunningMoments,
    merge_moments,
    moments_over_ranks,
    normalize_scores,
    value_clip_radius,
)
from learner.forward import all_reduce
from learner.losses import value_loss

# One process: moments_over_ranks over a world of one rank.
batch_moments = functools.partial(moments_over_ranks, reduce_sum=functools.partial(all_reduce, op="sum"))


def T(x):
    return torch.tensor(x, dtype=torch.float32)


def test_merge_moments_by_hand():
    # {1, 2, 3}: n 3, mean 2, M2 2;  {10}: n 1, mean 10, M2 0.
    # Union {1, 2, 3, 10}: mean 4, M2 = 9 + 4 + 1 + 36 = 50;  Chan: d = 8, 2 + 0 + 64 * 3 * 1 / 4 = 50.
    assert batch_moments(T([1, 2, 3, 99]), T([1, 1, 1, 0])) == (3.0, 2.0, 2.0)
    assert merge_moments((3, 2.0, 2.0), (1, 10.0, 0.0)) == (4.0, 4.0, 50.0)
    assert merge_moments((0, 0.0, 0.0), (1, 10.0, 0.0)) == (1.0, 10.0, 0.0)
    assert merge_moments((3, 2.0, 2.0), (0, 0.0, 0.0)) == (3.0, 2.0, 2.0)
    assert batch_moments(T([float("nan")]), T([0])) == (0.0, 0.0, 0.0)  # padding (even NaN) is never read
    rm = RunningMoments()
    assert rm.std == 1.0  # nothing seen yet: no scaling
    rm.update(3, 2.0, 2.0)
    rm.update(1, 10.0, 0.0)
    assert (rm.count, rm.mean, rm.m2) == (4.0, 4.0, 50.0)
    assert rm.std == pytest.approx((50 / 3) ** 0.5)  # Bessel-corrected


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(
        st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=0, max_size=12), min_size=1, max_size=8
    ),
    shift=st.floats(-1e6, 1e6),
)
def test_running_moments_equal_numpy_on_the_concatenated_data(chunks, shift):
    """Batches merged one by one (as the learner does step after step, each itself the merge of ranks'
    shards) give numpy's mean and sample std of everything, also far from zero (the shift)."""
    rm = RunningMoments()
    for chunk in chunks:
        x = torch.tensor([v + shift for v in chunk], dtype=torch.float64)
        # Each step's batch is split over two "ranks" and merged first, as distributed_moments does.
        half = len(chunk) // 2
        a = batch_moments(x[:half], torch.ones(half))
        b = batch_moments(x[half:], torch.ones(len(chunk) - half))
        rm.update(*merge_moments(a, b))
    everything = np.array([v + shift for c in chunks for v in c], dtype=np.float64)
    assert rm.count == len(everything)
    if len(everything):
        assert rm.mean == pytest.approx(everything.mean(), rel=1e-9, abs=1e-6)
    if len(everything) >= 2:
        assert rm.std == pytest.approx(everything.std(ddof=1), rel=1e-6, abs=1e-6)
    restored = RunningMoments()
    restored.load_state_dict(rm.state_dict())
    assert restored.state_dict() == rm.state_dict()


def test_normalize_scores_by_hand():
    s = T([4.0, -2.0, 1.0])
    assert torch.equal(normalize_scores(s, 1.0, 2.0, "off"), s)
    torch.testing.assert_close(normalize_scores(s, 1.0, 2.0, "scale", eps=0.0), T([2.0, -1.0, 0.5]))
    torch.testing.assert_close(normalize_scores(s, 1.0, 2.0, "standardize", eps=0.0), T([1.5, -1.5, 0.0]))
    torch.testing.assert_close(normalize_scores(s, 1.0, 2.0, "scale", clip=1.0, eps=0.0), T([1.0, -1.0, 0.5]))
    with pytest.raises(
        ValueError, match="unknown reward normalisation 'z'; allowed: off, scale, standardize"
    ):
        normalize_scores(s, 0.0, 1.0, "z")


def test_value_clip_modes_by_hand():
    assert value_clip_radius("absolute", 0.2, returns_std=6.0) == 0.2
    assert value_clip_radius("relative", 0.2, returns_std=6.0) == pytest.approx(1.2)
    assert value_clip_radius("off", 0.2, returns_std=6.0) is None
    with pytest.raises(ValueError, match="unknown value clip 'x'; allowed: absolute, relative, off"):
        value_clip_radius("x", 0.2)
    values, old, ret, mask = T([[1.5, 1.1]]), T([[1.0, 1.0]]), T([[2.0, 0.0]]), torch.ones(1, 2)
    # off: 1/2 (0.5^2 + 1.1^2) / 2 tokens
    loss, m = value_loss(values, old, ret, mask, clip_eps=None)
    assert float(loss) == pytest.approx((0.5 * 0.25 + 0.5 * 1.21) / 2) and m["clip_frac"] == 0.0
    # per-token radius: token 0 radius 0.2 (clipped V 1.2 -> 0.64), token 1 radius 1 (V inside -> 1.21)
    loss, m = value_loss(values, old, ret, mask, clip_eps=T([[0.2, 1.0]]))
    assert float(loss) == pytest.approx((0.5 * 0.64 + 0.5 * 1.21) / 2) and m["clip_frac"] == 0.5
    # a radius tensor equal everywhere is the number
    a, _ = value_loss(values, old, ret, mask, clip_eps=torch.full((1, 2), 0.2))
    b, _ = value_loss(values, old, ret, mask, clip_eps=0.2)
    assert float(a) == float(b)


def test_config_names_the_allowed_values():
    assert LearnerConfig().value_clip == "absolute" and LearnerConfig().reward_norm == "off"
    with pytest.raises(ValueError, match="value_clip") as err:
        LearnerConfig(value_clip="relativ")
    assert "'absolute', 'relative' or 'off'" in str(err.value)
    with pytest.raises(ValueError, match="reward_norm"):
        LearnerConfig(reward_norm="whiten")
    # YAML's bare `off` arrives as False
    assert LearnerConfig(value_clip=False, reward_norm=False).value_clip == "off"
    with pytest.raises(ValueError, match="value_clip"):
        LearnerConfig(value_clip=True)
    with pytest.raises(ValueError, match="reward_norm_clip"):
        LearnerConfig(reward_norm_clip=0.0)


def _one_process(values):
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def test_critic_stats_and_score_normalisation_in_one_process():
    from learner.critic import critic_stats, moments_over_ranks, normalized_rewards

    # returns [1, 2, 3 | pad], values [1, 1, 1]: Var(R) = 1, R - V = [0, 1, 2] -> Var 1: EV = 0.
    ret, val, mask = T([[1.0, 2.0], [3.0, 9.0]]), T([[1.0, 1.0], [1.0, 5.0]]), T([[1, 1], [1, 0]])
    assert moments_over_ranks(ret, mask, _one_process) == (3.0, 2.0, 2.0)
    s = critic_stats(val, ret, mask, _one_process)
    assert s["returns/std"] == pytest.approx(1.0) and s["values/explained_variance"] == pytest.approx(0.0)
    assert critic_stats(ret, ret, mask, _one_process)["values/explained_variance"] == pytest.approx(1.0)

    cfg = LearnerConfig(reward_norm="standardize")
    rm = RunningMoments()
    scores = T([2.0, float("nan"), 4.0, 6.0])  # the NaN row is left out of the statistics
    out, turns, stats = normalized_rewards(scores, cfg, rm, _one_process)
    assert (stats["reward_norm/count"], stats["reward_norm/mean"], stats["reward_norm/std"]) == (
        3.0,
        4.0,
        2.0,
    )
    torch.testing.assert_close(out[[0, 2, 3]], T([-1.0, 0.0, 1.0]))
    assert torch.isnan(out[1]) and turns is None  # still NaN: the step is skipped as before
    same, _, none = normalized_rewards(scores, LearnerConfig(), None, _one_process)
    assert same is scores and none == {}
    with pytest.raises(ValueError, match="needs running reward moments"):
        normalized_rewards(scores, cfg, None, _one_process)


def test_value_lr_puts_the_value_head_in_its_own_parameter_group(tiny_policy_dir):
    from learner.deepspeed_setup import build_optimizer
    from learner.model import PolicyWithValueHead

    model = PolicyWithValueHead.from_pretrained(tiny_policy_dir)
    one = build_optimizer(model, LearnerConfig(lr=1e-4))
    assert [g["lr"] for g in one.param_groups] == [1e-4]  # the default: one group, as before
    two = build_optimizer(model, LearnerConfig(lr=1e-4, value_lr=1e-3))
    assert [g["lr"] for g in two.param_groups] == [1e-4, 1e-3]
    head = {id(p) for p in model.value_head.parameters()}
    assert {id(p) for p in two.param_groups[1]["params"]} == head
    assert len(two.param_groups[0]["params"]) + len(head) == len(list(model.parameters()))
    assert not head & {id(p) for p in two.param_groups[0]["params"]}
