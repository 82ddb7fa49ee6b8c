"""Records the rollout role returns. Arrays are numpy so Ray moves them without pickling copies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length"]


@dataclass
class Sample:
    """One sampled response to one prompt.

    `logprobs[i]` is the behaviour log-probability of `response_ids[i]` under the sampling
    distribution (temperature applied, before top-k/top-p truncation). The response includes
    the EOS token when `finish_reason == "stop"`.
    """

    prompt_index: int
    prompt_ids: np.ndarray  # int64 [p]
    response_ids: np.ndarray  # int64 [r], r >= 1
    logprobs: np.ndarray  # float32 [r]
    finish_reason: FinishReason
    policy_version: int
    sample_index: int = 0  # k-th of the n samples drawn for this prompt
