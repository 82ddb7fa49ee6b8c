"""The parameter blocks of the off-policy correction presets that take parameters, each declared by its
registry entry (`learner.registry.OFF_POLICY`, `Part.section`) and held by the learner's section under
the preset's name (`learner.tis`, `learner.mask`, `learner.geo_mask`), read (and allowed) only when
`learner.off_policy` names that preset ('auto' names none: set the preset to tune it). The composed
'custom' correction reads `learner.rollout_correction` (learner/config_blocks.py). This module imports
no torch: the config is validated without it."""

from __future__ import annotations

from pydantic import Field, model_validator

from kernel.strict import Strict


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
