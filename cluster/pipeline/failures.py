"""The step's failure budgets, one rule for both pipelines: a step stops the run when more than
`reward.max_failure_frac` of its samples' rewards failed, or more than
`rollout.environment.max_failure_frac` of its episodes' environments failed."""

from __future__ import annotations

from cluster.config.schema import RunConfig
from cluster.pipeline.chunks import Parts, env_errors, reward_errors


class RewardFailureError(RuntimeError):
    """Too many rewards of one step failed (reward.max_failure_frac)."""


class EnvironmentFailureError(RuntimeError):
    """Too many episodes of one step failed in their environment (rollout.environment.max_failure_frac)."""


def check_failures(cfg: RunConfig, step: int, parts: Parts, total: int) -> None:
    """Raise when the failures among the step's `total` samples pass either budget."""
    for errors, frac, field, what, error in (
        (
            reward_errors(parts),
            cfg.reward.max_failure_frac,
            "reward.max_failure_frac",
            "rewards",
            RewardFailureError,
        ),
        (
            env_errors(parts),
            cfg.rollout.environment.max_failure_frac,
            "rollout.environment.max_failure_frac",
            "episodes' environments",
            EnvironmentFailureError,
        ),
    ):
        if len(errors) > frac * total:
            raise error(
                f"step {step}: {len(errors)}/{total} {what} failed (> {field}={frac}); first errors: {errors[:3]}"
            )
