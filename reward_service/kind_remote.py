"""reward.kind='remote': an HTTP endpoint scores each batch of prompt and response texts
(`reward_service.remote`)."""

from __future__ import annotations

from typing import Any

from reward_service.config import RewardConfig
from reward_service.remote import RemoteRewardClient
from reward_service.samples import Samples, ScoreBatch


class RemoteBackend:
    def __init__(self, config: RewardConfig, model: Any = None) -> None:
        self.client = RemoteRewardClient.from_config(config)
        self.batch_size = config.batch_size

    def score(self, samples: Samples, out: ScoreBatch) -> None:
        """One request per reward.batch_size samples; a failed request fails its own samples only."""
        prompts, responses, _full = samples.texts
        live, bs = samples.live, self.batch_size
        for k in range(0, len(live), bs):
            rows = live[k : k + bs]
            try:
                scores = self.client.score(
                    [prompts[i] for i in rows], [responses[i] for i in rows], [samples.meta[i] for i in rows]
                )
            except Exception as e:
                for i in rows:
                    out.fail(i, f"remote reward failed: {type(e).__name__}: {e}")
                continue
            for i, s in zip(rows, scores, strict=True):
                if s is None:
                    out.fail(i, "remote reward returned null for this sample")
                else:
                    out.set(i, s, "remote reward")
