"""reward.kind='model': a sequence-classification model scores each sample's prompt + response text."""

from __future__ import annotations

from typing import Any

from reward_service.classifier import ClassifierReward
from reward_service.config import RewardConfig
from reward_service.samples import Samples, ScoreBatch, file_scores


class ModelBackend:
    def __init__(self, config: RewardConfig, model: Any = None) -> None:
        if not config.model_path:
            raise ValueError("reward.kind='model' needs reward.model_path")
        self.classifier = ClassifierReward(
            config.model_path, config.score, config.positive_label, config.batch_size, config.dtype
        )

    def score(self, samples: Samples, out: ScoreBatch) -> None:
        if not samples.live:
            return
        full_text = samples.texts[2]
        scores, errors = self.classifier.score_texts([full_text[i] for i in samples.live])
        file_scores(out, samples.live, scores, errors, "reward model")
