"""Dr. GRPO's constant normaliser and GSPO's sequence-level ratio, each one registered part
(learner.registry): numbers worked by hand from the papers' definitions, and the gradient against an
independent implementation of each paper's objective."""

from __future__ import annotations

import math

import pytest
import torch

from learner.advantages import grpo_advantages
from learner.losses import aggregate_loss, policy_loss

T = torch.tensor
# Two responses of one prompt: 2 and 4 valid tokens of a width of 4.
MASK = T([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])


# ----------------------------------------------------------------------------- Dr. GRPO (Liu et al. 2025)


def test_dr_grpo_divides_each_sequence_sum_by_the_constant_by_hand():
    loss = T([[1.0, 2.0, 99.0, 99.0], [3.0, 4.0, 5.0, 6.0]])  # 99: padding never counts
    # (1/N) sum_i (1/L) sum_t l_it with N = 2 sequences and L = 8: ((1 + 2) + (3 + 4 + 5 + 6)) / (2 * 8)
    got = aggregate_loss(loss, MASK, "seq-mean-token-sum-norm", horizon=8)
    assert float(got) == pytest.approx(21 / 16)
    # GRPO's per-sequence mean, for contrast: (3/2 + 18/4) / 2
    assert float(aggregate_loss(loss, MASK, "seq-mean-token-mean")) == pytest.approx(3.0)


def test_dr_grpo_gives_every_token_the_same_weight_whatever_its_length():
    """The point of removing 1/|y_i|: d loss / d l_it is 1/(N L) for every valid token, where GRPO's
    per-sequence mean gives a token of the 2-token response twice the weight of one of the 4-token one."""
    loss = torch.zeros(2, 4, requires_grad=True)
    aggregate_loss(loss, MASK, "seq-mean-token-sum-norm", horizon=8).backward()
    assert loss.grad.tolist() == [[1 / 16, 1 / 16, 0, 0], [1 / 16] * 4]
    loss.grad = None
    aggregate_loss(loss, MASK, "seq-mean-token-mean").backward()
    assert loss.grad.tolist() == [[1 / 4, 1 / 4, 0, 0], [1 / 8] * 4]


def test_dr_grpo_pieces_add_up_to_the_batch_with_global_counts():
    """Micro-batches on several ranks divide by the batch's sequence count, so they sum to the whole."""
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = (torch.arange(6) < T([[6], [1], [3], [0], [4]])).double()  # a row with no token is no sequence
    whole = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", horizon=6)
    pieces = sum(
        aggregate_loss(loss[s], mask[s], "seq-mean-token-sum-norm", global_seqs=4.0, horizon=6)
        for s in (slice(0, 2), slice(2, 5))
    )
    assert float(pieces) == pytest.approx(float(whole), rel=1e-12)


def test_dr_grpo_objective_equals_the_papers_by_hand():
    """Dr. GRPO = grpo without the std (grpo.norm_adv_by_std false) and the constant normaliser.
    Scores 1 and 0: advantages +0.5 and -0.5 on every token. With pi = pi_old every ratio is 1, so the
    loss is -(1/G) sum_i (1/L) |y_i| A_i = -(2 * 0.5 + 4 * (-0.5)) / (2 * 8) = 1/16: the longer,
    wrong response weighs more, where GRPO's per-sequence mean makes the two cancel."""
    adv_seq = grpo_advantages(T([1.0, 0.0]), T([0, 0]), std_normalize=False)
    assert adv_seq.tolist() == [0.5, -0.5]
    adv = adv_seq.unsqueeze(-1).expand(2, 4) * MASK
    lp = torch.zeros(2, 4)
    dr, _ = policy_loss(lp, lp, adv, MASK, agg="seq-mean-token-sum-norm", horizon=8)
    grpo, _ = policy_loss(lp, lp, adv, MASK, agg="seq-mean-token-mean")
    assert float(dr) == pytest.approx(1 / 16) and float(grpo) == pytest.approx(0.0)


def test_dr_grpo_without_its_constant_names_the_field():
    with pytest.raises(ValueError, match="learner.loss_norm_tokens"):
        aggregate_loss(torch.ones(2, 4), MASK, "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- GSPO (Zheng et al. 2025)


def _gspo_paper(lp, old, adv_seq, mask, low, high):
    """The paper's objective as written (eq. 5-7), independently: (1/G) sum_i max(-A_i s_i, -A_i clip(s_i))
    with s_i = exp((1/|y_i|) sum_t (log pi - log pi_old))."""
    n = mask.sum(-1)
    s = torch.exp(((lp - old) * mask).sum(-1) / n)
    per_seq = torch.maximum(-adv_seq * s, -adv_seq * s.clamp(1 - low, 1 + high))
    return per_seq.mean()


def test_gspo_by_hand():
    """Row 0: log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214 > 1 + 0.1, A = +1: clipped at -1.1, no gradient.
    Row 1: log-ratios -0.2, 0, 0, 0.1 -> s = e^-0.025 = 0.9753, A = -1: unclipped, loss s, and
    d loss / d log pi_t = s / 4 on each of its tokens."""
    old = torch.zeros(2, 4)
    lp = T([[0.1, 0.3, 7.0, 7.0], [-0.2, 0.0, 0.0, 0.1]]).requires_grad_(True)
    adv = T([[1.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    loss, m = policy_loss(lp, old, adv, MASK, clip_eps=0.1, agg="seq-mean-token-mean", loss="gspo")
    s1 = math.exp(-0.025)
    assert float(loss.detach()) == pytest.approx((-1.1 + s1) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, T([[0.0] * 4, [s1 / 4 / 2] * 4]), atol=1e-6, rtol=0)
    # every token of row 0 is on the clipped branch, none of row 1: 2 of the 6 valid tokens
    assert m["clip_frac"] == pytest.approx(2 / 6)
    assert m["ratio_max"] == pytest.approx(math.exp(0.2), rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_loss_and_gradient_equal_the_papers_sequence_objective(seed):
    g = torch.Generator().manual_seed(seed)
    B, W = 6, 7
    lengths = torch.randint(1, W + 1, (B,), generator=g)
    mask = (torch.arange(W) < lengths.unsqueeze(1)).double()
    old = -torch.rand(B, W, generator=g, dtype=torch.float64) * 3
    base = (old + 0.05 * torch.randn(B, W, generator=g, dtype=torch.float64)).detach()
    adv_seq = torch.randn(B, generator=g, dtype=torch.float64)
    adv = adv_seq.unsqueeze(-1) * mask
    low, high = 0.003, 0.004  # small, as in the paper (3e-4 / 4e-4 there), so some rows clip
    lp_ours = base.clone().requires_grad_(True)
    ours, _ = policy_loss(lp_ours, old, adv, mask, low, high, agg="seq-mean-token-mean", loss="gspo")
    ours.backward()
    lp_ref = base.clone().requires_grad_(True)
    ref = _gspo_paper(lp_ref, old, adv_seq, mask, low, high)
    ref.backward()
    assert float(ours) == pytest.approx(float(ref), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(lp_ours.grad * mask, lp_ref.grad * mask, rtol=1e-9, atol=1e-12)


def test_gspo_token_advantages_weight_each_tokens_gradient_by_the_sequence_ratio():
    """GSPO-token: with per-token advantages A_it (a KL penalty in the reward) and no clip, the gradient
    on token t is -sg(s_i) A_it / |y_i| / N: the sequence's ratio, the token's own advantage."""
    lp = T([[0.2, -0.1, 0.0, 0.0]], dtype=torch.float64).requires_grad_(True)
    old = torch.zeros(1, 4, dtype=torch.float64)
    mask = T([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = T([[2.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss(lp, old, adv, mask, clip_eps=10.0, agg="seq-mean-token-mean", loss="gspo")
    loss.backward()
    s = math.exp(0.05)
    torch.testing.assert_close(lp.grad, T([[-s * 2 / 2, s * 1 / 2, 0.0, 0.0]], dtype=torch.float64))


def test_gspo_and_ppo_agree_on_one_token_responses():
    """A response of one token has s_i = r_i: the two losses are one."""
    g = torch.Generator().manual_seed(1)
    lp, old = torch.randn(5, 1, generator=g), torch.randn(5, 1, generator=g)
    adv, mask = torch.randn(5, 1, generator=g), torch.ones(5, 1)
    a, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean", loss="gspo")
    b, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-mean", loss="ppo")
    assert float(a) == pytest.approx(float(b), rel=1e-6)


# ----------------------------------------------------------------------------- CISPO (MiniMax-M1, Chen et al. 2025)


def test_cispo_by_hand():
    """Row 0: log-ratios 0.3, -0.4 -> r = 1.3499 (clipped to 1.2), 0.6703 (clipped to 0.8), A = +1, -1.
    Row 1: log-ratios 0.1, 0, 0, -0.1 -> r = 1.1052, 1, 1, 0.9048 (none clipped), A = +2.
    Per token L = -sg(clip(r)) * A * log pi; 'token-mean' over the 6 valid tokens. The gradient
    d L / d log pi_t = -clip(r_t) * A_t / 6: every token keeps one (PPO's clip would zero row 0's)."""
    old = torch.zeros(2, 4)
    lp = T([[0.3, -0.4, 7.0, 7.0], [0.1, 0.0, 0.0, -0.1]]).requires_grad_(True)
    adv = T([[1.0, -1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    loss, m = policy_loss(lp, old, adv, MASK, clip_eps=0.2, agg="token-mean", loss="cispo")
    w = [1.2, 0.8, math.exp(0.1), 1.0, 1.0, math.exp(-0.1)]
    a = [1.0, -1.0, 2.0, 2.0, 2.0, 2.0]
    x = [0.3, -0.4, 0.1, 0.0, 0.0, -0.1]
    assert float(loss.detach()) == pytest.approx(
        -sum(wi * ai * xi for wi, ai, xi in zip(w, a, x, strict=True)) / 6, abs=1e-6
    )
    loss.backward()
    g = [-wi * ai / 6 for wi, ai in zip(w, a, strict=True)]
    torch.testing.assert_close(lp.grad, T([[g[0], g[1], 0.0, 0.0], g[2:]]), atol=1e-6, rtol=0)
    assert m["clip_frac"] == pytest.approx(2 / 6)  # the two of row 0 lay outside [0.8, 1.2]


def test_cispo_refuses_a_dual_clip_by_name():
    from learner.config import LearnerConfig

    with pytest.raises(ValueError, match=r"learner.clip.dual applies to policy_loss \['ppo', 'gspo'\]"):
        LearnerConfig(policy_loss="cispo", clip={"dual": 3.0})
