"""The reward scorer actor: policy token ids in, one scalar per sample out, failures reported per sample."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from learner.algorithms import episode_return
from reward_service.config import RewardConfig
from reward_service.functions import RewardInput
from reward_service.values import score_problem
from reward_service.weighted import load_functions, score_functions


@dataclass
class ScoreBatch:
    """Scores of one batch. A failed sample has ok=False, score and return NaN and an error text: never a
    silent 0.

    `scores[i]` is what stands on sample i's last token; `returns[i]` the reward the sample earned in all
    (`learner.algorithms.episode_return`: the score plus the rewards of an episode's earlier turns when they
    are trained, else the score), which every reader of a sample's reward takes: dynamic sampling's filter,
    rollout/reward_mean, and (from the same rewards) the learner's group advantages.

    `turn_rewards` says where a multi-turn episode's reward comes from (the one rule, set by
    `RewardScorer.score`): with reward.kind='environment' from ALL of the environment's turn rewards (the
    last turn's is the score, on the episode's last model token; each earlier one stays on its turn's last
    token), with any other kind from the score alone (NONE of the environment's rewards is trained).

    `function_values` (reward functions, kind='rule'): each function's own value per sample, unweighted,
    NaN where it failed or did not run; the score is their weighted sum (`reward_service.weighted`).
    `function_failures`: per function, True where it ran and failed (what the per-function failure counts
    count)."""

    scores: np.ndarray  # float32 [n]
    returns: np.ndarray  # float32 [n]
    ok: np.ndarray  # bool [n]
    errors: list[str | None] = field(default_factory=list)
    turn_rewards: bool = False  # the episodes' earlier-turn rewards are trained beside the score
    function_values: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 [n]
    function_failures: dict[str, np.ndarray] = field(default_factory=dict)  # name -> bool [n]

    @classmethod
    def empty(cls, n: int) -> ScoreBatch:
        nan = np.full(n, np.nan, dtype=np.float32)
        return cls(nan, nan.copy(), np.zeros(n, dtype=bool), [None] * n)

    def set(self, i: int, value: Any, source: str, token_rewards: np.ndarray | None = None) -> None:
        """Record a score after checking it is a finite number (anything else marks the sample failed),
        and the sample's return: the score plus `token_rewards` (an episode's earlier turns' rewards on
        their tokens, when they are trained), or the score alone."""
        problem = score_problem(value)
        if problem is not None:
            self.fail(i, f"{source} {problem}")
        else:
            self.scores[i] = float(value)
            single = token_rewards is None
            self.returns[i] = self.scores[i] if single else episode_return(self.scores[i], token_rewards)
            self.ok[i] = True
            self.errors[i] = None

    def fail(self, i: int, error: str) -> None:
        self.scores[i] = np.nan
        self.returns[i] = np.nan
        self.ok[i] = False
        self.errors[i] = error


class RewardScorer:
    """Scores samples with a reward model, reward functions, a remote endpoint, an LLM judge or the
    environment (`config.kind`).

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
        self._classifier = None
        self._functions = None
        self._remote = None
        self._judge = None
        if config.kind == "model":
            if not config.model_path:
                raise ValueError("reward.kind='model' needs reward.model_path")
            from reward_service.classifier import ClassifierReward

            self._classifier = ClassifierReward(
                config.model_path, config.score, config.positive_label, config.batch_size, config.dtype
            )
        elif config.kind == "rule":
            if not config.function_entries():
                raise ValueError(
                    "reward.kind='rule' needs reward.rule (a registered rule name) or reward.functions"
                )
            self._functions = load_functions(config)
        elif config.kind == "remote":
            from reward_service.remote import RemoteRewardClient

            self._remote = RemoteRewardClient.from_config(config)
        elif config.kind == "judge":
            from reward_service.judge import JudgeReward

            self._judge = JudgeReward(config.judge, config.batch_size, config.dtype, model=judge_model)
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
        for i, e in enumerate(episodes):
            if e is not None and e.failed:
                out.fail(i, f"environment {e.status}: {e.error}")
        if self.config.kind == "environment":
            out.turn_rewards = True
            for i, e in enumerate(episodes):
                if e is None:
                    out.fail(
                        i,
                        "reward.kind='environment' but the sample is no episode (rollout.environment.name unset)",
                    )
                elif not e.failed:
                    out.set(i, e.outcome, "environment", e.token_rewards())
            self._count(n, out, start)
            return out
        prompt_text, response_text, full_text = self._decode(prompts, responses, out)
        live = [i for i in range(n) if out.errors[i] is None]  # failed episodes already carry their error
        if self._classifier is not None:
            self._score_model([full_text[i] for i in live], live, out)
        elif self._functions is not None or self._judge is not None:
            inputs = [
                RewardInput(
                    prompt=prompt_text[i] if prompt_texts is None else prompt_texts[i],
                    messages=None if messages is None else messages[i],
                    response=response_text[i],
                    response_ids=np.asarray(responses[i], dtype=np.int64).tolist(),
                    finish_reason=None if finish_reasons is None else finish_reasons[i],
                    meta=meta[i],
                )
                for i in live
            ]
            if self._judge is not None:
                self._score_judge(inputs, live, out)
            else:

                def name(k: int) -> str:  # input k as a hang's message names it (asked only then)
                    i = live[k]
                    return _row_name(
                        f"sample {i}" if rows is None else f"prompt row {rows[i]}", inputs[k].prompt
                    )

                self._score_functions(inputs, live, out, name)
        else:
            self._score_remote(prompt_text, response_text, meta, live, out)
        self._count(n, out, start)
        return out

    def _count(self, n: int, out: ScoreBatch, start: float) -> None:
        self._samples += n
        self._failures += int((~out.ok).sum())
        self._calls += 1
        self._busy_s += time.perf_counter() - start

    def _decode(
        self, prompts: list[np.ndarray], responses: list[np.ndarray], out: ScoreBatch
    ) -> tuple[list[str], list[str], list[str]]:
        """Prompt, response and prompt+response texts; the joint decode keeps the tokenizer's own spacing."""
        texts: tuple[list[str], list[str], list[str]] = ([], [], [])
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            p_ids = np.asarray(p, dtype=np.int64).tolist()
            r_ids = np.asarray(r, dtype=np.int64).tolist()
            try:
                parts = [
                    self.tokenizer.decode(x, skip_special_tokens=True) for x in (p_ids, r_ids, p_ids + r_ids)
                ]
            except Exception as e:
                out.fail(i, f"cannot decode policy token ids: {type(e).__name__}: {e}")
                parts = ["", "", ""]
            for acc, text in zip(texts, parts, strict=True):
                acc.append(text)
        return texts

    def _score_model(self, texts: list[str], index: list[int], out: ScoreBatch) -> None:
        assert self._classifier is not None
        if not index:
            return
        scores, errors = self._classifier.score_texts(texts)
        _file(out, index, scores, errors, "reward model")

    def _score_functions(
        self, inputs: list[RewardInput], index: list[int], out: ScoreBatch, name: Callable[[int], str]
    ) -> None:
        """The weighted sum of the reward functions as each sample's score, each function's values and
        where it failed; a function that hangs past reward.function_timeout_s raises, naming its inputs'
        rows (`name(k)`: input k)."""
        assert self._functions is not None
        timeout = self.config.function_timeout_s
        scored = score_functions(self._functions, inputs, self.config.batch_size, timeout, name)
        for k, i in enumerate(index):
            if scored.errors[k] is not None:
                out.fail(i, scored.errors[k])
            else:
                out.set(i, scored.total[k], "the reward functions' weighted sum")
        for name, values in scored.values.items():
            column = np.full(len(out.ok), np.nan, dtype=np.float32)
            column[index] = values
            out.function_values[name] = column
            failed = np.zeros(len(out.ok), dtype=bool)
            failed[index] = scored.failed[name]
            out.function_failures[name] = failed

    def _score_judge(self, inputs: list[RewardInput], index: list[int], out: ScoreBatch) -> None:
        assert self._judge is not None
        scores, errors, _replies = self._judge.score(inputs)
        _file(out, index, scores, errors, "judge")

    def _score_remote(
        self, prompts: list[str], responses: list[str], meta: list[dict], live: list[int], out: ScoreBatch
    ) -> None:
        assert self._remote is not None
        bs = self.config.batch_size
        for k in range(0, len(live), bs):
            rows = live[k : k + bs]
            try:
                scores = self._remote.score(
                    [prompts[i] for i in rows], [responses[i] for i in rows], [meta[i] for i in rows]
                )
            except Exception as e:  # one failed request fails its own samples only
                for i in rows:
                    out.fail(i, f"remote reward failed: {type(e).__name__}: {e}")
                continue
            for i, s in zip(rows, scores, strict=True):
                if s is None:
                    out.fail(i, "remote reward returned null for this sample")
                else:
                    out.set(i, s, "remote reward")


def _row_name(label: str, prompt: str) -> str:
    """A sample as messages name it: `label` (its prompt row) and the start of its prompt's text."""
    text = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    return f"{label} ({text!r})"


def _file(out: ScoreBatch, index: list[int], scores, errors: list[str | None], source: str) -> None:
    """A backend's scores and errors (one each per sample of `index`) onto the batch's rows."""
    for i, value, err in zip(index, scores, errors, strict=True):
        if err is None:
            out.set(i, value, source)
        else:
            out.fail(i, err)
