"""When a step skips the learner's proximal pass ("bypass"): the engine's behaviour logprobs are the old ones.

The PPO ratio pi_theta / pi_old is taken against the policy that sampled the batch. The learner normally
recomputes pi_old's logprobs in a no-grad forward (`learner.prepare.proximal_pass`), because in general the
sampler's numbers are not the learner's: older weights (async, partial rollouts), other numerics (a bf16
engine), values the same forward must produce. Where none of that holds, the forward recomputes what the
engine returned already, up to float rounding (~1e-6 nats per token on float32 here), so it is skipped; TRL
does the same when it takes generate()'s scores, and verl's rollout correction calls it bypass mode.

A step bypasses when all of these hold (`decide`), the same on every rank:
- `learner.proximal_pass` is 'auto' and the driver vouches that every rollout engine acknowledged, by the
  digests of the weights it holds, exactly the learner's current weights, version `engines_hold` (the sync
  pipeline, rollout.dtype equal to learner.dtype, no environment; `cluster.pipeline.learner_calls`);
- every trajectory on every rank was sampled at that version (v1 or later: the engines' v0 was read from
  disk, not checked against the learner);
- the estimator learns no values and the reference is not computed from the learner's base weights (both
  need the forward) and no off-policy correction is asked for;
- the step is not a check step: the rank's first step and every `learner.proximal_check_every`-th run the
  pass anyway, and measure the engine-learner gap (`rollout/logprob_gap`). A gap above `GAP_LIMIT` ends the
  bypass for the rest of the run (`record`, said in `train/proximal_bypass_off`).

On a bypassed step `rollout/logprob_gap` is NaN (not measured) and `train/proximal_bypassed` is 1.

`learner.proximal_pass: bypass` is the explicit choice (verl's bypass mode, slime's
--use-rollout-logprobs): every step takes the behaviour logprobs as the old ones, whatever the engines hold,
so the PPO ratio is pi_theta / mu and its clip is the only correction of the mismatch; the config refuses it
where the forward is needed (a critic, reference_from_base) or a correction would read rho = 1
(learner/config_rules.py). Nothing is measured then (the mismatch metrics are NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from learner.advantages import needs_critic
from learner.config import LearnerConfig

# Mean |proximal - behaviour| logprob per token above which the engine's numbers are not the learner's:
# float32 engines on equal weights agree to ~1e-6 (cluster.weights.push.PROBE_TOLERANCE: 1e-4 atol).
GAP_LIMIT = 1e-4


def static_reason(config: LearnerConfig) -> str | None:
    """Why this config never bypasses (None: it may)."""
    if config.proximal_pass == "always":
        return "learner.proximal_pass='always'"
    if config.proximal_pass == "bypass":
        return None  # chosen: decide() bypasses every step
    if needs_critic(config.advantage):
        return f"learner.advantage={config.advantage!r} learns values in the same forward"
    if config.reference_from_base:
        return "learner.reference_from_base computes the reference in the same pass"
    if config.off_policy not in ("none", "auto"):
        return f"learner.off_policy={config.off_policy!r}"
    return None


@dataclass
class ProximalBypass:
    """One rank's bypass state: the steps it has taken and whether a measured gap ended the bypass."""

    config: LearnerConfig
    steps: int = 0
    off_gap: float | None = None  # the gap that ended the bypass, when one did

    def __post_init__(self) -> None:
        self.never = static_reason(self.config)  # why this config never bypasses (None: it may)

    def decide(
        self, versions: Sequence[int], engines_hold: int | None, all_ranks: Callable[[bool], bool]
    ) -> bool:
        """Whether this step skips the proximal pass. `versions`: this rank's trajectories' policy versions;
        `all_ranks(flag)`: True when `flag` is true on every rank (a collective: every rank calls it)."""
        check = self.steps % self.config.proximal_check_every == 0
        self.steps += 1
        if self.config.proximal_pass == "bypass":
            return True  # the explicit bypass mode: the same on every rank, no check steps
        if self.never or self.off_gap is not None or check or not engines_hold:
            return False  # the same on every rank (config, step count, global gap, the driver's word)
        return all_ranks(all(v == engines_hold for v in versions))

    def record(self, stats: dict[str, float], bypassed: bool) -> dict[str, float]:
        """The step's bypass metrics; a measured gap over GAP_LIMIT ends the bypass for the run."""
        gap = stats.get("rollout/logprob_gap", math.nan)
        may_bypass = self.never is None and self.off_gap is None
        if may_bypass and not bypassed and math.isfinite(gap) and gap > GAP_LIMIT:
            self.off_gap = gap
            print(
                f"learner: the engines' logprobs differ from the learner's by {gap:.2e} nats per token "
                f"(over {GAP_LIMIT:g}): the proximal pass runs on every step from now on",
                flush=True,
            )
        return {
            "train/proximal_bypassed": float(bypassed),
            "train/proximal_bypass_off": float(self.off_gap is not None),
        }
