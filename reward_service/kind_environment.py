"""reward.kind='environment': each multi-turn episode's environment gives its reward, all of it: the
score is the episode's outcome (its last turn's reward) and its earlier turns' rewards are trained too
(`ScoreBatch.turn_rewards`)."""

from __future__ import annotations

from typing import Any

from reward_service.config import RewardConfig
from reward_service.samples import Samples, ScoreBatch


class EnvironmentBackend:
    def __init__(self, config: RewardConfig, model: Any = None) -> None:
        pass

    def score(self, samples: Samples, out: ScoreBatch) -> None:
        """Reads the episodes only (no text is decoded); a failed episode keeps its error."""
        for i, e in enumerate(samples.episodes):
            if e is None:
                out.fail(
                    i,
                    "reward.kind='environment' but the sample is no episode (rollout.environment.name unset)",
                )
            elif not e.failed:
                out.set(i, e.outcome, "environment", e.token_rewards())
