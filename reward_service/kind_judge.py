"""reward.kind='judge': a causal LM prompted with each sample gives its verdict (`reward_service.judge`)."""

from __future__ import annotations

from typing import Any

from reward_service.config import RewardConfig
from reward_service.judge import JudgeReward
from reward_service.samples import Samples, ScoreBatch, file_scores


class JudgeBackend:
    def __init__(self, config: RewardConfig, model: Any = None) -> None:
        """`model`: what serves the judge (`reward_service.judge.JudgeModel`); None: the transformers
        model of reward.judge.engine='hf' (the cluster builds the other engines')."""
        self.judge = JudgeReward(config.judge, config.batch_size, config.dtype, model=model)

    def score(self, samples: Samples, out: ScoreBatch) -> None:
        scores, errors, _replies = self.judge.score(samples.inputs())
        file_scores(out, samples.live, scores, errors, "judge")
