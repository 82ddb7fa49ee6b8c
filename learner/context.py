"""What every pass of one learner step reads besides the batch (`LearnerContext`), named once instead
of handed from function to function as six loose arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from learner.config import LearnerConfig
from learner.critic import RunningMoments


@dataclass(frozen=True)
class LearnerContext:
    """The DeepSpeed engine (and so the device), the learner's config, the sampling temperature the
    logprobs are taken at (the rollout's), the pad id of dummy micro-batches, the generator of the
    minibatch order and the running score moments `learner.reward_norm` normalises with (updated in
    place; None when it is off)."""

    engine: Any
    config: LearnerConfig
    temperature: float
    pad_id: int
    generator: torch.Generator | None = None
    reward_moments: RunningMoments | None = None

    @property
    def device(self) -> torch.device:
        return self.engine.device
