"""The step's failure budgets, one rule for both pipelines: a step stops the run when more than
`reward.max_failure_frac` of its samples' rewards failed, or more than
`rollout.environment.max_failure_frac` of its episodes' environments failed. The failures below the
threshold are recorded first (the first ones printed with their prompt row and kept in the run folder,
`cluster.reporting.reward_failures`), so that an abort's too."""

from __future__ import annotations

from cluster.config.schema import RunConfig
from cluster.records.chunks import Parts, env_errors, reward_errors
from cluster.reporting.reward_failures import RewardFailureLog


class RewardFailureError(RuntimeError):
    """Too many rewards of one step failed (reward.max_failure_frac)."""


class EnvironmentFailureError(RuntimeError):
    """Too many episodes of one step failed in their environment (rollout.environment.max_failure_frac)."""


def check_failures(cfg: RunConfig, step: int, parts: Parts, total: int, log: RewardFailureLog) -> None:
    """Record the step's reward failures in `log`, then raise when the failures among the step's `total`
    samples pass either budget."""
    log.record(parts, f"step {step}")
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
