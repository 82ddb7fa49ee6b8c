"""Off-policy corrections (tis, mask, geo_mask) and the log-ratio clamp, with hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.algorithms import LOG_RATIO_CLAMP
from learner.losses import off_policy_weights, policy_loss

# Row 0: rho = pi_prox / mu = [2, 1, 3]; row 1: rho = [0.25, 1] then one padded position.
PROX = torch.log(torch.tensor([[1.0, 0.5, 0.9], [0.1, 0.4, 0.7]]))
MU = torch.log(torch.tensor([[0.5, 0.5, 0.3], [0.4, 0.4, 0.2]]))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _w(mode, **kw):
    w, m = off_policy_weights(PROX, MU, MASK, mode, **kw)
    return w, m


def test_tis_is_min_of_ratio_and_cap():
    w, m = _w("tis", cap=2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 2.5], [0.25, 1.0, 0.0]]), atol=1e-6)
    assert m["clipped_frac"] == pytest.approx(1 / 5)  # only the 3.0 token is capped
    assert m["weight_max"] == pytest.approx(2.5, abs=1e-6)
    assert m["weight_mean"] == pytest.approx((2 + 1 + 2.5 + 0.25 + 1) / 5, abs=1e-6)


def test_mask_drops_tokens_above_the_cap():
    w, m = _w("mask", cap=2.5)
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["clipped_frac"] == pytest.approx(1 / 5)


def test_geo_mask_keeps_or_drops_whole_sequences():
    # Geometric means: row 0 (2*1*3)^(1/3) = 1.817; row 1 (0.25*1)^(1/2) = 0.5.
    w, m = _w("geo_mask", geo_bounds=(0.5, 2.0))
    assert torch.equal(w, MASK)  # both inside [0.5, 2]
    w, m = _w("geo_mask", geo_bounds=(0.6, 2.0))
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert m["clipped_frac"] == pytest.approx(2 / 5)
    w, _ = _w("geo_mask", geo_bounds=(0.5, 1.5))
    assert torch.equal(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_behaviour_kl_is_k3_of_mu_against_prox():
    _, m = _w("none")
    rho = torch.tensor([2.0, 1.0, 3.0, 0.25, 1.0])
    want = float(((rho - 1) - torch.log(rho)).mean())
    assert m["behaviour_kl"] == pytest.approx(want, rel=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["none", "tis", "mask", "geo_mask"]), st.integers(0, 2**31))
def test_weights_are_one_when_behaviour_equals_proximal(mode, seed):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand((4, 6), generator=g) * 5
    mask = (torch.arange(6) < torch.randint(1, 7, (4, 1), generator=g)).float()
    w, m = off_policy_weights(lp, lp.clone(), mask, mode)
    assert torch.equal(w, mask)
    assert m["clipped_frac"] == 0.0
    assert m["behaviour_kl"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("mode", ["tis", "mask", "geo_mask"])
def test_padding_is_never_read(mode):
    prox, mu = PROX.clone(), MU.clone()
    prox[1, 2], mu[1, 2] = float("nan"), float("inf")
    w_nan, m_nan = off_policy_weights(prox, mu, MASK, mode, cap=2.5)
    w, m = off_policy_weights(PROX, MU, MASK, mode, cap=2.5)
    assert torch.equal(w_nan, w) and m_nan == m


def test_bad_arguments_name_the_allowed_values():
    with pytest.raises(ValueError, match="none, tis, mask, geo_mask"):
        off_policy_weights(PROX, MU, MASK, "vtrace")
    with pytest.raises(ValueError, match="lo <= 1 <= hi"):
        off_policy_weights(PROX, MU, MASK, "geo_mask", geo_bounds=(1.2, 2.0))


def test_one_extreme_token_cannot_make_the_policy_loss_infinite():
    lp = torch.tensor([[0.0, -1.0, -2.0]])
    old = torch.tensor([[-1000.0, -1.0, -2.0]])  # log-ratio 1000 on token 0: exp overflows without a clamp
    adv = torch.tensor([[-1.0, 0.5, 0.5]])
    mask = torch.ones(1, 3)
    loss, m = policy_loss(lp, old, adv, mask, clip_eps=0.2)
    assert math.isfinite(float(loss))
    assert m["log_ratio_clamped"] == 1.0
    # Token 0: A < 0, ratio = e^20 (clamped): max(-A*ratio, -A*1.2) = e^20; tokens 1, 2: -0.5 each.
    assert float(loss) == pytest.approx((math.exp(LOG_RATIO_CLAMP) - 1.0) / 3, rel=1e-5)
