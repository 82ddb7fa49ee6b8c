"""The reward scorer actor: policy token ids in, one scalar per sample out, failures reported per sample."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from reward_service.backends import REWARD_KINDS
from reward_service.config import RewardConfig
from reward_service.samples import Samples, ScoreBatch

__all__ = ["RewardScorer", "ScoreBatch"]  # ScoreBatch: written by the backends (reward_service.samples)


class RewardScorer:
    """Scores samples with the one backend of its reward kind (`config.kind`, `reward_service.backends`):
    a reward model, reward functions, a remote endpoint, an LLM judge or the environment.

    A plain class: `cluster/` wraps it with `ray.remote`; tests call it directly.
    """

    def __init__(
        self,
        config: RewardConfig,
        policy_tokenizer_path: str,
        torch_threads: int = 1,
        judge_model: Any = None,
    ) -> None:
        """`judge_model` (kind='judge'): what serves the judge (`reward_service.judge.JudgeModel`); default
        the transformers model of reward.judge.engine='hf' (the cluster builds the other engines')."""
        torch.set_num_threads(torch_threads)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(policy_tokenizer_path)
        self.kind = REWARD_KINDS[config.kind]
        self.backend = REWARD_KINDS.function(config.kind)(config, judge_model)
        self._samples = 0
        self._failures = 0
        self._calls = 0
        self._busy_s = 0.0

    def ping(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        return {
            "samples": float(self._samples),
            "failures": float(self._failures),
            "calls": float(self._calls),
            "busy_s": self._busy_s,
        }

    def score(
        self,
        prompts: list[np.ndarray],
        responses: list[np.ndarray],
        meta: list[dict] | None = None,
        episodes: list[Any] | None = None,
        *,
        prompt_texts: list[str] | None = None,
        messages: list[list[dict] | None] | None = None,
        finish_reasons: list[str] | None = None,
        rows: list[int] | None = None,
    ) -> ScoreBatch:
        """One score per sample. `episodes[i]` (a `rollout_workers.environment.Episode`, or None) is the
        multi-turn record of sample i: an episode whose environment failed is failed here (dropped and
        counted, never scored). With kind='environment' the environment's rewards are the reward, all of
        them: the score is the episode's outcome (its last turn's reward) and `turn_rewards` is set, so the
        earlier turns' rewards are trained too; any other kind scores the decoded transcript and its score
        is the episode's whole reward (none of the environment's turn rewards is used).

        Reward functions (kind='rule') also see each prompt's rendered text and chat messages and each
        response's finish reason (`RewardInput`): a run passes them all; a direct caller without
        `prompt_texts` has the prompt ids decoded instead, without `messages` or `finish_reasons` None.
        `rows[i]` is sample i's prompt row (its index in the prompts files), named when a reward function
        hangs on it (reward.function_timeout_s)."""
        n = len(prompts)
        meta = [{} for _ in range(n)] if meta is None else list(meta)
        episodes = [None] * n if episodes is None else list(episodes)
        given = {
            "prompt texts": prompt_texts,
            "messages": messages,
            "finish reasons": finish_reasons,
            "rows": rows,
        }
        lengths = [len(meta), len(episodes), *(len(v) for v in given.values() if v is not None)]
        if len(responses) != n or any(k != n for k in lengths):
            described = "".join(f", {len(v)} {k}" for k, v in given.items() if v is not None)
            raise ValueError(
                f"{n} prompts, {len(responses)} responses, {len(meta)} meta entries, "
                f"{len(episodes)} episodes{described}"
            )
        start = time.perf_counter()
        out = ScoreBatch.empty(n)
        out.turn_rewards = self.kind.turn_rewards
        for i, e in enumerate(episodes):
            if e is not None and e.failed:
                out.fail(i, f"environment {e.status}: {e.error}")
        samples = Samples(
            list(prompts),
            list(responses),
            meta,
            episodes,
            prompt_texts,
            messages,
            finish_reasons,
            rows,
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
        )
        self.backend.score(samples, out)
        for i, error in samples.undecodable.items():
            out.fail(i, error)
        self._count(n, out, start)
        return out

    def _count(self, n: int, out: ScoreBatch, start: float) -> None:
        self._samples += n
        self._failures += int((~out.ok).sum())
        self._calls += 1
        self._busy_s += time.perf_counter() - start
