"""Records the rollout role returns. Arrays are numpy so Ray moves them without pickling copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from rollout_workers.environment import Episode

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
    # multi-turn rollouts (rollout.environment): response_ids are every token after the prompt, model
    # turns and observations; logprobs are 0 on observation tokens; finish_reason is 'stop' when the
    # environment ended the episode, else 'length'. None: one model turn, no environment.
    episode: Episode | None = None
    # pipeline.partial_rollout: int64 [r], the policy version that sampled each response token (an
    # observation token carries the version of the model token before it); None: every token was
    # sampled by `policy_version`, which is always the oldest token's version
    token_versions: np.ndarray | None = None
    # rollout.record_routing (an MoE policy): uint8 [p + r - 1, layers, k], the experts the engine's MoE
    # layers chose for every token of prompt_ids + response_ids but the last (which the engine never
    # forwards, and which no logprob of the sample depends on); after a weight swap mid-sample
    # (partial_rollout) the routing of the recomputed prefill. None: not recorded
    routing: np.ndarray | None = None

    def versions(self) -> np.ndarray:
        """The policy version of every response token."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(len(self.response_ids), self.policy_version, dtype=np.int64)


@dataclass
class WeightAck:
    """A worker's acknowledgement of a weight load: the version it now samples with, and what its
    engine computes with those weights.

    `probe[i]` holds the engine's teacher-forced logprobs of tokens 1.. of the i-th fixed probe sequence
    (`kernel.sequences.probe_sequences(vocab)`); the learner computes the same on the weights it
    exported. `checksum` is `state_checksum` of the weights read back from the engine (None where the
    engine cannot read them back, as vLLM).

    Digests (`rollout_workers.weights.sampled_digest`, cheap at any size) tell version v from v+1 after
    one optimizer step, which the probe's tolerance cannot: `received` is the bundle's as the worker got
    it; `held` the engine's own after the load when it names tensors as the bundle does (hf), else
    None; `changed` whether the engine's digest moved in this load and `bundle_changed` whether the
    bundle differs from the one this worker loaded before (None for its first load).
    """

    version: int
    probe: list[np.ndarray] | None  # None: the push did not ask for the probe (rollout.probe_every)
    checksum: str | None = None
    received: str | None = None
    held: str | None = None
    changed: bool | None = None
    bundle_changed: bool | None = None
    # seconds of the worker's stages: 'load_s' (receive and load), 'checksum_s', 'digest_s', 'probe_s'
    timings: dict[str, float] = field(default_factory=dict)
