"""The rollout-correction family against verl's formulas (verl/trainer/ppo/rollout_corr_helper.py at
volcengine/verl HEAD), re-implemented here independently (verl is not imported) on shared cases."""

from __future__ import annotations

import math

import pytest
import torch
from test_off_policy_corrections import MASK, MU, PROX, _c, _run

from learner.corrections import correction_weights

# ----- verl's rollout-correction formulas (verl/trainer/ppo/rollout_corr_helper.py), re-implemented -----
SAFETY = 20.0


def _mmean(x, m, dim=None):
    return (x * m).sum() / m.sum() if dim is None else (x * m).sum(dim) / m.sum(dim)


def _verl(old, rollout, m, rollout_is, is_thr, rollout_rs, rs_lo, rs_hi):
    """verl's compute_rollout_correction_and_rejection_mask: IS weights (exp of the clamped token or
    summed log-ratio, times the mask, truncated at the threshold), the k1 rejection (on -log rho, its
    'ratio' bounds applied to that: keep iff log lo <= stat <= log hi), the final weight IS x the
    modified response mask, and compute_offpolicy_metrics' kl, k3_kl and ppl_ratio."""
    lr = old - rollout
    if rollout_is == "token":
        w = torch.exp(lr.clamp(-SAFETY, SAFETY))
    elif rollout_is == "sequence":
        w = torch.exp((lr * m).sum(-1, keepdim=True).clamp(-SAFETY, SAFETY)).expand_as(lr)
    else:
        w = torch.ones_like(lr)
    w = (w * m).clamp(max=is_thr)
    stats = {
        "token_k1": -lr,
        "seq_sum_k1": (-lr * m).sum(-1, keepdim=True).expand_as(lr),
        "seq_mean_k1": _mmean(-lr, m, -1).unsqueeze(-1).expand_as(lr),
    }
    keep = torch.ones_like(lr)
    for option in filter(None, rollout_rs.split(",")):  # every option must pass
        stat = stats[option]
        keep = keep * ((stat >= math.log(rs_lo)) & (stat <= math.log(rs_hi))).float()
    new_mask = m * keep
    metrics = {
        "kl": float(_mmean(rollout - old, m)),
        "k3_kl": float(_mmean(torch.exp(lr) - lr - 1, m)),
        "ppl_ratio": float(torch.exp(_mmean(rollout, m, -1) - _mmean(old, m, -1)).mean()),
        "rs_masked_fraction": float(_mmean(1 - keep, m)),
        "rs_seq_masked_fraction": float(((keep < 0.5) & (m > 0)).any(-1).float().mean()),
    }
    return w * new_mask, metrics


OURS_TO_VERL_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
HI = {"": 2.0, "token": 1.5, "sequence": 3.0, "geometric": 1.25, "geometric,token": 1.5}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("is_level", ["none", "token", "sequence"])
@pytest.mark.parametrize("reject", sorted(HI))
def test_the_family_equals_verls_formulas_on_shared_cases(seed, is_level, reject):
    """Symmetric bounds (lo = 1/hi), verl's own default: there verl's k1 rejection on -log rho and ours
    on log rho coincide (see test_verls_k1_bounds_apply_to_the_inverse_ratio for asymmetric ones).
    'geometric,token' is verl's comma-separated rollout_rs "seq_mean_k1,token_k1" (every option must pass)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand((5, 7), generator=g) * 3
    rollout = old + torch.randn((5, 7), generator=g) * 0.4
    lengths = torch.randint(1, 8, (5, 1), generator=g)
    m = (torch.arange(7) < lengths).float()
    hi, levels = HI[reject], [x for x in reject.split(",") if x]
    c = _c(is_level, 2.0, *[(level, (1 / hi, hi)) for level in levels])
    w, sums, mx = correction_weights(old, rollout, m, c)
    ours = sums.metrics(mx)
    verl_rs = ",".join(OURS_TO_VERL_RS[level] for level in levels)
    want_w, want = _verl(old, rollout, m, is_level, 2.0, verl_rs, 1 / hi, hi)
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6)
    assert ours["off_policy/behaviour_kl_k1"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-6)
    assert ours["off_policy/behaviour_kl"] == pytest.approx(want["k3_kl"], rel=1e-4, abs=1e-6)
    assert ours["off_policy/ppl_ratio"] == pytest.approx(want["ppl_ratio"], rel=1e-5)
    assert ours["off_policy/masked_token_frac"] == pytest.approx(want["rs_masked_fraction"], abs=1e-6)
    assert ours["off_policy/masked_seq_frac"] == pytest.approx(want["rs_seq_masked_fraction"], abs=1e-6)


def test_verls_k1_bounds_apply_to_the_inverse_ratio():
    """verl's token_k1 statistic is -log rho = log(mu/pi), so its "lower_upper" ratio bounds keep
    1/hi <= rho <= 1/lo; ours keep lo <= rho <= hi, as verl's documentation describes its bounds. With
    [0.3, 2.5] on the shared case (rho 2, 1, 3 | 0.25, 1): ours drop 3 (above 2.5) and 0.25 (below 0.3);
    verl's keep [1/2.5, 1/0.3] = [0.4, 3.33]: 3 kept, 0.25 dropped."""
    ours, _ = _run("none", 2.0, ("token", (0.3, 2.5)))
    verl, _ = _verl(PROX, MU, MASK, "none", 1e9, "token_k1", 0.3, 2.5)
    assert torch.equal(ours, torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    assert torch.equal(verl, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
