"""The contract every engine is held to, on the way in and on the way out of a generate call.

The rule: a backend's bug fails here, naming the prompt or the engine, and never reaches the learner.
A prompt is a non-empty 1-D array of integer token ids inside the vocabulary that leaves room for a
response (within the model's positions; with an environment, within its total-token budget). An
output has 1..limit tokens, one logprob each, and an EOS or stop token only at the end, exactly when
its finish_reason is 'stop'. Pure functions of the engine's limits: no lock, no state.
"""

from __future__ import annotations

import numpy as np

from rollout_workers.config import SamplingConfig
from rollout_workers.engine import GenerationOutput, RolloutEngine


def check_prompt(
    index: int,
    prompt: np.ndarray,
    sampling: SamplingConfig,
    vocab_size: int,
    max_model_len: int | None,
    episode_budget: int | None,
) -> np.ndarray:
    """`prompt` (the caller's prompt `index`) as an owned int64 copy, or a ValueError naming what is
    wrong. `episode_budget` is `rollout.environment.max_total_tokens` when the worker runs multi-turn
    episodes (the prompt must leave room for a model turn), None for single-turn calls (prompt plus
    `sampling.max_new_tokens` must fit `max_model_len`, where the engine has one)."""
    p = np.asarray(prompt)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"prompt {index} must be a non-empty 1-D array of token ids, got shape {p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"prompt {index} has dtype {p.dtype}; token ids must be integers")
    if p.min() < 0 or p.max() >= vocab_size:
        raise ValueError(
            f"prompt {index} has token ids outside [0, {vocab_size}): min {p.min()}, max {p.max()}"
        )
    if episode_budget is not None and p.size >= episode_budget:
        raise ValueError(
            f"prompt {index} has {p.size} tokens: no room for a model turn within "
            f"rollout.environment.max_total_tokens={episode_budget}"
        )
    limit = max_model_len
    if episode_budget is None and limit is not None and p.size + sampling.max_new_tokens > limit:
        raise ValueError(
            f"prompt {index} has {p.size} tokens; with max_new_tokens={sampling.max_new_tokens} "
            f"it exceeds the model's {limit} positions"
        )
    return np.array(p, dtype=np.int64)  # an owned, writable copy (Ray hands in read-only views)


def check_outputs(
    engine: RolloutEngine,
    outputs: list[list[GenerationOutput]],
    n_prompts: int,
    sampling: SamplingConfig,
    stop_ids: frozenset[int] = frozenset(),
    limits: list[int] | None = None,
) -> None:
    """Hold `engine`'s outputs for `n_prompts` prompts to the contract: `sampling.n` samples a prompt,
    1..limit tokens (default `sampling.max_new_tokens`), one logprob each, an EOS or stop token only
    at the end and exactly when finish_reason is 'stop'. Converts each output's arrays to int64 token
    ids and float32 logprobs in place."""
    name = engine.name
    if len(outputs) != n_prompts or any(len(o) != sampling.n for o in outputs):
        raise RuntimeError(
            f"{name} engine returned {[len(o) for o in outputs]} samples for {n_prompts} prompts x n={sampling.n}"
        )
    eos = engine.eos_token_ids | stop_ids
    limits = limits or [sampling.max_new_tokens] * n_prompts
    for outs, limit in zip(outputs, limits, strict=True):
        for o in outs:
            r = len(o.response_ids)
            if r < 1 or r > limit or len(o.logprobs) != r:
                raise RuntimeError(f"{name} engine returned {r} tokens with {len(o.logprobs)} logprobs")
            ends_with_eos = int(o.response_ids[-1]) in eos
            if any(int(t) in eos for t in o.response_ids[:-1]):
                raise RuntimeError(f"{name} engine returned tokens after an EOS token: {o.response_ids}")
            if (o.finish_reason == "stop") != ends_with_eos:
                raise RuntimeError(
                    f"{name} engine: finish_reason {o.finish_reason!r} but last token {o.response_ids[-1]}"
                )
            o.response_ids = np.asarray(o.response_ids, dtype=np.int64)
            o.logprobs = np.asarray(o.logprobs, dtype=np.float32)
