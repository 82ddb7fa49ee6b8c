"""The record the learner takes: one scored trajectory (`cluster` builds these from rollout samples).

numpy only, so the driver can build them without importing torch; `learner.batch` packs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Trajectory:
    prompt_ids: np.ndarray  # int64 [p]
    response_ids: np.ndarray  # int64 [r]
    behaviour_logprobs: np.ndarray  # float32 [r], from the generator
    # float32 [r], from the frozen reference; None where the learner computes them itself from the
    # policy's base weights with the LoRA adapters off (learner.reference_from_base)
    ref_logprobs: np.ndarray | None
    score: float  # sequence-level reward, placed on the last response token
    policy_version: int = 0
    group: int = -1  # samples of one prompt share an id (>= 0); -1 = a group of its own
    truncated: bool = (
        False  # cut at max_new_tokens (no EOS); a multi-turn episode the environment did not end
    )
    # Multi-turn episodes: 1 on tokens the policy sampled, 0 on observation tokens (None: all sampled).
    # Only sampled tokens are actions: they alone carry losses, KL and advantages.
    action_mask: np.ndarray | None = None  # uint8 [r]
    # Rewards on tokens besides the score (an episode's earlier turns, each on its turn's last token, when
    # its environment's rewards are the reward); None: the score is the whole reward.
    token_rewards: np.ndarray | None = None  # float32 [r]
    # An MoE policy's routing as the engine recorded it (rollout.record_routing): uint8 [p + r - 1, layers, k],
    # the experts of every token of prompt + response but the last; None: not recorded.
    routing: np.ndarray | None = None
