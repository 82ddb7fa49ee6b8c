"""The parameter blocks of the off-policy correction presets that take parameters, each declared by its
registry entry (`learner.registry.OFF_POLICY`, `Part.section`) and held by the learner's section under
the preset's name (`learner.tis`, `learner.mask`, `learner.geo_mask`), read (and allowed) only when
`learner.off_policy` names that preset ('auto' names none: set the preset to tune it). The composed
'custom' correction's block is `learner.rollout_correction` (its entry names that field and requires
it). This module imports no torch: the config is validated without it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kernel.strict import Strict
from learner.registry import ROLLOUT_IS, ROLLOUT_REJECT

RolloutISName = Literal[ROLLOUT_IS.names()]
RolloutRejectName = Literal[ROLLOUT_REJECT.names()]


class TISParams(Strict):
    """off_policy 'tis': truncated importance sampling per token, min(rho_t, cap) (Espeholt et al.
    2018; verl's rollout_is_threshold, OpenRLHF's vllm_is_truncated_threshold)."""

    cap: float = Field(2.0, gt=0.0, description="The truncation C of rho_t = pi_prox/mu.")


class MaskParams(Strict):
    """off_policy 'mask': token rejection, weight 1[rho_t <= cap]."""

    cap: float = Field(2.0, gt=0.0, description="The largest rho_t = pi_prox/mu a token keeps.")


class GeoMaskParams(Strict):
    """off_policy 'geo_mask': sequence rejection on the geometric-mean ratio (prod_t rho_t)^(1/|y|)."""

    bounds: tuple[float, float] = Field(
        (0.5, 2.0), description="[lo, hi], 0 < lo <= 1 <= hi: the kept range of the geometric-mean ratio."
    )

    @model_validator(mode="after")
    def _check(self) -> GeoMaskParams:
        lo, hi = self.bounds
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"learner.geo_mask.bounds must satisfy 0 < lo <= 1 <= hi (got {(lo, hi)})")
        return self


class RejectConfig(Strict):
    """One rejection of learner.rollout_correction.reject."""

    level: RolloutRejectName = Field(description=f"What is rejected: {ROLLOUT_REJECT.describe()}.")
    bounds: tuple[float, float] = Field(
        description="[lo, hi], 0 <= lo <= 1 <= hi: the kept range of the ratio the level reads (lo 0: one-sided)."
    )

    @model_validator(mode="after")
    def _check(self) -> RejectConfig:
        lo, hi = self.bounds
        if not 0 <= lo <= 1 <= hi:
            raise ValueError(
                f"learner.rollout_correction.reject bounds must satisfy 0 <= lo <= 1 <= hi (got {(lo, hi)})"
            )
        return self


class RolloutCorrectionConfig(Strict):
    """off_policy 'custom': a rollout correction composed of an IS part and rejections; each token's weight
    is the IS weight times every rejection's multiplier (learner/corrections.py)."""

    is_level: RolloutISName = Field(
        "none", description=f"Importance weight, rho = pi_prox/mu: {ROLLOUT_IS.describe()}."
    )
    is_cap: float = Field(2.0, gt=0.0, description="The truncation C of is_level 'token' and 'sequence'.")
    reject: list[RejectConfig] = Field(
        default_factory=list,
        description="Rejections, each {level, bounds: [lo, hi]} with 0 <= lo <= 1 <= hi the kept range of the "
        "ratio the level reads (lo 0: one-sided); a token is kept when every one keeps it (SkyRL stacks "
        f"geometric, token and outlier masks; IcePop's paper uses [0.5, 5]); empty: none. level: "
        f"{ROLLOUT_REJECT.describe()}.",
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        icepops = sum(r.level == "icepop" for r in self.reject)
        if icepops and (self.is_level != "none" or icepops > 1):
            raise ValueError(
                "learner.rollout_correction: an 'icepop' rejection weights its kept tokens by rho itself: "
                f"is_level must be 'none' (got {self.is_level!r}) and icepop listed once (got {icepops})"
            )
        return self
