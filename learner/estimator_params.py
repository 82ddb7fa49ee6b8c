"""The parameter blocks of the advantage estimators that take parameters of their own, each declared by
its registry entry (`learner.registry.ADVANTAGES`, `Estimator.section`) and held by the learner's
section under the estimator's name (`learner.gae`, `learner.vtrace`, `learner.grpo`), read (and allowed)
only when `learner.advantage` selects that estimator. A field's name is the one of `AdvantageParams`
(learner/advantages.py) it sets. This module imports no torch: the config is validated without it."""

from __future__ import annotations

from pydantic import Field, model_validator

from kernel.strict import Strict


class GAEParams(Strict):
    """advantage 'gae': GAE(gamma, lambda) (Schulman et al. 2015; verl's algorithm.lam, OpenRLHF's
    --lambd)."""

    lam: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description="lambda of A_t = delta_t + gamma * lambda * A_{t+1}: 1 is the Monte-Carlo return minus "
        "V, 0 the one-step TD error.",
    )


class VTraceParams(Strict):
    """advantage 'vtrace': V-trace's truncation levels and trace factor (Espeholt et al. 2018, IMPALA's
    rho-bar and c-bar)."""

    rho_clip: float = Field(
        1.0, gt=0.0, description="rho-bar, truncation of the importance weight in the TD error."
    )
    c_clip: float = Field(
        1.0, gt=0.0, description="c-bar (<= rho_clip), truncation of the trace-cutting weights."
    )
    lam: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description="lambda of the trace-cutting weights c_t = lambda * min(c_clip, pi/mu) (V-trace with "
        "lambda = 1 and pi = mu is GAE(lambda = 1)).",
    )

    @model_validator(mode="after")
    def _check(self) -> VTraceParams:
        if self.c_clip > self.rho_clip:
            raise ValueError(
                f"learner.vtrace.c_clip={self.c_clip} must be <= learner.vtrace.rho_clip={self.rho_clip}"
            )
        return self


class GRPOParams(Strict):
    """advantage 'grpo': the group-relative advantage (Shao et al. 2024)."""

    norm_adv_by_std: bool = Field(
        True,
        description="Divide the group-centred score by the group's standard deviation (verl's "
        "algorithm.norm_adv_by_std_in_grpo); false, with loss_agg 'seq-mean-token-sum-norm', is Dr. GRPO "
        "(Liu et al. 2025).",
    )
