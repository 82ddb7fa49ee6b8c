"""What a reward backend reads and writes: one scoring call's samples (`Samples`, decoded on first use)
and their scores (`ScoreBatch`, one value or one error per sample)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from learner.algorithms import episode_return
from reward_service.functions import RewardInput
from reward_service.values import score_problem


@dataclass
class ScoreBatch:
    """Scores of one batch. A failed sample has ok=False, score and return NaN and an error text: never a
    silent 0.

    `scores[i]` is what stands on sample i's last token; `returns[i]` the reward the sample earned in all
    (`learner.algorithms.episode_return`: the score plus the rewards of an episode's earlier turns when they
    are trained, else the score), which every reader of a sample's reward takes: dynamic sampling's filter,
    rollout/reward_mean, and (from the same rewards) the learner's group advantages.

    `turn_rewards` says where a multi-turn episode's reward comes from (the one rule, set by
    `RewardScorer.score` from the kind's `turn_rewards`, `reward_service.backends`): with
    reward.kind='environment' from ALL of the environment's turn rewards (the
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


@dataclass
class Samples:
    """One scoring call's samples, as every backend reads them (`RewardScorer.score` builds it).

    The ids, `meta` and `episodes` are per sample; `prompt_texts`, `messages`, `finish_reasons` and
    `rows` are per sample or None where the caller gave none. The texts are decoded by `decode` (the
    policy tokenizer's) on first use only, so a backend that reads no text (the environment's) decodes
    nothing; a sample that cannot be decoded is in `undecodable` (its error), out of `live`."""

    prompt_ids: list[np.ndarray]
    response_ids: list[np.ndarray]
    meta: list[dict]
    episodes: list[Any]
    prompt_texts: list[str] | None
    messages: list[list[dict] | None] | None
    finish_reasons: list[str] | None
    rows: list[int] | None
    decode: Callable[[list[int]], str]
    undecodable: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @functools.cached_property
    def texts(self) -> tuple[list[str], list[str], list[str]]:
        """Prompt, response and prompt+response texts; the joint decode keeps the tokenizer's own spacing."""
        texts: tuple[list[str], list[str], list[str]] = ([], [], [])
        for i, (p, r) in enumerate(zip(self.prompt_ids, self.response_ids, strict=True)):
            p_ids = np.asarray(p, dtype=np.int64).tolist()
            r_ids = np.asarray(r, dtype=np.int64).tolist()
            try:
                parts = [self.decode(x) for x in (p_ids, r_ids, p_ids + r_ids)]
            except Exception as e:
                self.undecodable[i] = f"cannot decode policy token ids: {type(e).__name__}: {e}"
                parts = ["", "", ""]
            for acc, text in zip(texts, parts, strict=True):
                acc.append(text)
        return texts

    @functools.cached_property
    def live(self) -> list[int]:
        """The samples to score: their episode (if any) did not fail and they decoded."""
        self.texts  # noqa: B018 -- decodes, filling `undecodable`
        return [
            i
            for i, e in enumerate(self.episodes)
            if i not in self.undecodable and (e is None or not e.failed)
        ]

    def inputs(self) -> list[RewardInput]:
        """A `RewardInput` per live sample: the prompt's rendered text (decoded where the caller gave
        none), its messages, the response's text and ids, its finish reason and the prompt row's meta."""
        prompt_text, response_text, _full = self.texts
        return [
            RewardInput(
                prompt=prompt_text[i] if self.prompt_texts is None else self.prompt_texts[i],
                messages=None if self.messages is None else self.messages[i],
                response=response_text[i],
                response_ids=np.asarray(self.response_ids[i], dtype=np.int64).tolist(),
                finish_reason=None if self.finish_reasons is None else self.finish_reasons[i],
                meta=self.meta[i],
            )
            for i in self.live
        ]

    def name(self, i: int, prompt: str) -> str:
        """Sample i as messages name it: its prompt row (or its index) and the start of `prompt`."""
        label = f"sample {i}" if self.rows is None else f"prompt row {self.rows[i]}"
        text = prompt if len(prompt) <= 60 else prompt[:57] + "..."
        return f"{label} ({text!r})"


def file_scores(out: ScoreBatch, index: list[int], scores, errors: list[str | None], source: str) -> None:
    """A backend's scores and errors (one each per sample of `index`) onto the batch's rows."""
    for i, value, err in zip(index, scores, errors, strict=True):
        if err is None:
            out.set(i, value, source)
        else:
            out.fail(i, err)
