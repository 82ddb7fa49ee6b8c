"""The service's Tinker losses (`cluster.serve.losses`) on tokens worked by hand: importance sampling,
ppo, cross_entropy, cispo and gspo (values and gradients), and the refusals that name the loss, its
inputs and its config keys."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from cluster.serve.losses import LossBatch, lookup


def _batch(lp, q, adv, w=None) -> LossBatch:
    t = lambda x: torch.tensor([x], dtype=torch.float32)  # noqa: E731
    inputs = {"logprobs": t(q), "advantages": t(adv)} | ({"weights": t(w)} if w else {})
    return LossBatch(t(lp), inputs, torch.ones(1, len(lp)))


def test_tinker_losses_by_hand():
    """Two tokens with ratios r = 1.5 (A = +1) and 0.5 (A = -1), a third padded out of the mask."""
    b = _batch([np.log(1.5), np.log(0.5), 0.0], [0.0, 0.0, 0.0], [1.0, -1.0, 5.0], w=[2.0, 1.0, 9.0])
    b = LossBatch(b.logprobs, b.inputs, torch.tensor([[1.0, 1.0, 0.0]]))
    names = {"logprobs", "advantages", "weights"}
    # importance sampling: -(1.5 * 1 + 0.5 * -1) = -1.0
    assert float(lookup("importance_sampling", names, {})(b, {}).loss) == pytest.approx(-1.0, abs=1e-6)
    # ppo, clip [0.8, 1.2]: -(min(1.5, 1.2) * 1 + min(-0.5, -0.8)) = -(1.2 - 0.8) = -0.4
    assert float(lookup("ppo", names, {})(b, {}).loss) == pytest.approx(-0.4, abs=1e-6)
    # a wider clip [0.4, 2]: nothing clipped, as importance sampling
    wide = {"clip_low_threshold": 0.4, "clip_high_threshold": 2.0}
    assert float(lookup("ppo", names, wide)(b, wide).loss) == pytest.approx(-1.0, abs=1e-6)
    # cross entropy: -(2 * ln 1.5 + 1 * ln 0.5) = 0.693147 - 0.810930 = -0.117783
    ce = lookup("cross_entropy", names, {})(b, {})
    assert float(ce.loss) == pytest.approx(-(2 * np.log(1.5) + np.log(0.5)), abs=1e-6)
    assert ce.extra["elementwise_loss"][0, :2].tolist() == pytest.approx([-2 * np.log(1.5), -np.log(0.5)])


def test_cispo_and_gspo_by_hand():
    """The same two tokens: r = 1.5 (A = +1), 0.5 (A = -1), lp = ln r (q = 0), a third padded out.
    cispo, clip [0.8, 1.2]: -(1.2 * 1 * ln 1.5 + 0.8 * -1 * ln 0.5) = -1.041076; d L / d lp = -clip(r) A.
    gspo: s = exp((ln 1.5 + ln 0.5) / 2) = sqrt(0.75) = 0.866025 inside [0.8, 1.2], so each token's term
    is -A s: with A = (+1, +0.5), L = -1.5 s = -1.299038 and d L / d lp_t = -A_t s.
    gspo with sequence_ratio_mask on token 0 only (A = 0 on token 1): s = 1.5 clipped at 1.2: L = -1.2."""
    lp = torch.tensor([[np.log(1.5), np.log(0.5), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    q = torch.zeros(1, 3)

    def batch(adv, **more):
        inputs = {"logprobs": q, "advantages": torch.tensor([adv])} | {
            k: torch.tensor([v]) for k, v in more.items()
        }
        return LossBatch(lp, inputs, mask)

    names = {"logprobs", "advantages"}
    out = lookup("cispo", names, {})(batch([1.0, -1.0, 5.0]), {})
    assert float(out.loss) == pytest.approx(-(1.2 * np.log(1.5) - 0.8 * np.log(0.5)), abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad[0].tolist() == pytest.approx([-1.2, 0.8, 0.0], abs=1e-6)

    s = np.sqrt(0.75)
    out = lookup("gspo", names, {})(batch([1.0, 0.5, 5.0]), {})
    assert float(out.loss) == pytest.approx(-1.5 * s, abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad[0].tolist() == pytest.approx([-s, -0.5 * s, 0.0], abs=1e-6)

    masked = batch([1.0, 0.0, 5.0], sequence_ratio_mask=[1.0, 0.0, 0.0])
    assert float(lookup("gspo", names, {})(masked, {}).loss) == pytest.approx(-1.2, abs=1e-6)
    refused = batch([1.0, 0.5, 5.0], sequence_ratio_mask=[1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="tokens outside sequence_ratio_mask carry non-zero advantages"):
        lookup("gspo", names, {})(refused, {})


def test_tinker_losses_refuse_by_name():
    msg = "loss_fn 'importance_sampling' needs loss_fn_inputs ['logprobs', 'advantages'] (missing ['advantages'])"
    with pytest.raises(ValueError, match=re.escape(msg)):
        lookup("importance_sampling", {"logprobs"}, {})
    msg = "loss_fn 'importance_sampling' takes loss_fn_config keys [] (got ['kl_coeff'])"
    with pytest.raises(ValueError, match=re.escape(msg)):
        lookup("importance_sampling", {"logprobs", "advantages"}, {"kl_coeff": 0.1})
    msg = (
        "unknown Tinker loss 'dro' (forward_backward loss_fn); allowed: cross_entropy, importance_sampling, ppo, "
        "cispo, gspo"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        lookup("dro", set(), {})
