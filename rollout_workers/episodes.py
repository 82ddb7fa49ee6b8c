"""Multi-turn episodes, token in, token out: the engine's ids are kept exactly as sampled.

Every episode is a list of token ids that only grows: the prompt's ids, then each model turn's ids as
the engine returned them, then each observation tokenised once (`add_special_tokens=False`), or with
`observation_format: chat` rendered as a chat message by the policy's template
(`rollout_workers.chat_turns`), and appended. The next turn continues from those ids; nothing is ever re-tokenised, so the ids trained on
are the ids the policy produced (no chat-template or merge drift at turn boundaries). The loss mask is
1 on model tokens, 0 on observation tokens.

Turns are batched over the episodes still running: the first turn is exactly a single-turn
`generate` of the prompts (n samples each, the caller's seed), so an environment that ends every
episode after one turn gives the single-turn samples; turn t >= 1 generates each running episode once
from its ids with seed `derive_seed(seed, t)`. Environment calls of a turn run concurrently, each with
its own deadline (`EnvCaller`); a `reset` that answers after its deadline (its episode failed as
env_timeout) has its state closed when it comes (`environment.close`), counted in the worker's
`env_late_answers`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_workers.chat_turns import chat_observations
from rollout_workers.config import EnvironmentConfig, SamplingConfig
from rollout_workers.engine import GenerationOutput, Interrupt, RolloutEngine, derive_seed
from rollout_workers.env_calls import CallResult, EnvCaller
from rollout_workers.environment import Environment, Episode, TurnEnd, as_step, step_with

# (outputs, prompts, sampling, stop ids, limits): the worker's output contract, raised on a violation
Check = Callable[[list[list[GenerationOutput]], int, SamplingConfig, frozenset[int], list[int]], None]


@dataclass
class _Live:
    """One episode while it runs."""

    ids: list[int]
    prompt_len: int
    state: Any = None
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token (with an interrupt)
    mask: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    info: collections.Counter = field(default_factory=collections.Counter)
    env_s: float = 0.0
    status: str | None = None  # None while it runs
    error: str | None = None

    def fail(self, result: CallResult) -> None:
        self.status = "env_timeout" if result.timed_out else "env_error"
        self.error = f"timed out after {result.seconds:.1f}s" if result.timed_out else result.error
        self.env_s += result.seconds

    def record(self) -> tuple[np.ndarray, np.ndarray, Episode, np.ndarray | None]:
        episode = Episode(
            loss_mask=np.asarray(self.mask, dtype=np.uint8),
            turn_ends=np.asarray(self.turn_ends, dtype=np.int64),
            turn_rewards=np.asarray(self.turn_rewards, dtype=np.float32),
            status=self.status or "max_turns",
            error=self.error,
            info=dict(self.info),
            env_s=self.env_s,
        )
        response = np.asarray(self.ids[self.prompt_len :], dtype=np.int64)
        versions = np.asarray(self.versions, dtype=np.int64) if self.versions else None
        return response, np.asarray(self.logprobs, dtype=np.float32), episode, versions


def stop_token_ids(tokenizer: Any, stop_strings: list[str]) -> frozenset[int]:
    """The token id of each stop string; a ValueError naming the string when it is not exactly one token."""
    ids = set()
    for text in stop_strings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"rollout.environment.stop_strings: {text!r} is {len(encoded)} tokens of the policy's "
                f"tokenizer ({encoded}); each stop string must be exactly one token"
            )
        ids.add(int(encoded[0]))
    return frozenset(ids)


class EpisodeRunner:
    """Runs the episodes of one generate call on `engine` with `environment`."""

    def __init__(
        self, engine: RolloutEngine, tokenizer: Any, config: EnvironmentConfig, environment: Environment
    ) -> None:
        limit = engine.max_model_len
        if limit is not None and config.max_total_tokens > limit:
            raise ValueError(
                f"rollout.environment.max_total_tokens={config.max_total_tokens} exceeds the model's {limit} positions"
            )
        self.engine, self.tokenizer, self.config, self.environment = engine, tokenizer, config, environment
        self.stop_ids = stop_token_ids(tokenizer, config.stop_strings)
        self.caller = EnvCaller(config.timeout_s)
        self.turn_stops = engine.eos_token_ids | self.stop_ids
        self.chat = (
            chat_observations(
                tokenizer,
                config.observation_role,
                self.turn_stops,
                config.chat_template,
                config.chat_template_kwargs,
            )
            if config.observation_format == "chat"
            else None
        )

    def run(
        self,
        prompts: list[np.ndarray],
        texts: list[str],
        metas: list[dict],
        sampling: SamplingConfig,
        seed: int,
        check: Check,
        interrupt: Interrupt | None = None,
    ) -> list[list[tuple[np.ndarray, np.ndarray, Episode, np.ndarray | None]]]:
        """`sampling.n` episodes per prompt: (response ids, behaviour logprobs, episode facts, the version
        of each response token or None without an `interrupt`) each. With an `interrupt`, new weights
        may come in inside a turn's generation and between turns. Every episode's state is closed when
        the call ends, also when it raises (the error raised is the call's, never a close's)."""
        n = sampling.n
        episodes = [_Live([int(t) for t in p], len(p)) for p in prompts for _ in range(n)]
        try:
            self._play(episodes, prompts, texts, metas, sampling, seed, check, interrupt)
        finally:
            for ep in episodes:
                if ep.state is not None:
                    with contextlib.suppress(Exception):  # a failed clean-up changes no sample, no error
                        self.environment.close(ep.state)
        return [[episodes[i * n + k].record() for k in range(n)] for i in range(len(prompts))]

    def _play(
        self,
        episodes: list[_Live],
        prompts: list[np.ndarray],
        texts: list[str],
        metas: list[dict],
        sampling: SamplingConfig,
        seed: int,
        check: Check,
        interrupt: Interrupt | None,
    ) -> None:
        """Start `episodes` (`sampling.n` per prompt, in order) and run their turns until each has ended."""
        cfg, n = self.config, sampling.n
        turn_max = cfg.turn_max_new_tokens or sampling.max_new_tokens
        starts = self.caller.run(
            [
                (lambda text=text, meta=meta: self.environment.reset(text, dict(meta)))
                for text, meta in zip(texts, metas, strict=True)
                for _ in range(n)
            ],
            close_late=self.environment.close,  # a reset past its deadline: its episode failed, its state goes
        )
        for ep, result in zip(episodes, starts, strict=True):
            if result.ok:
                ep.state, ep.env_s = result.value, result.seconds
            else:
                ep.fail(result)  # still generated once below (a sample has >= 1 token), then dropped

        # turn 0: the prompts themselves, n samples each, exactly as a single-turn generate
        turn_sampling = sampling.model_copy(update={"max_new_tokens": turn_max})
        limits = [min(turn_max, cfg.max_total_tokens - len(p)) for p in prompts]
        outputs = self.engine.generate(prompts, turn_sampling, seed, self.stop_ids, limits, interrupt)
        check(outputs, len(prompts), turn_sampling, self.stop_ids, limits)
        self._advance(episodes, [o for outs in outputs for o in outs], turn=0)
        one = turn_sampling.model_copy(update={"n": 1})
        for turn in range(1, cfg.max_turns):
            live = [ep for ep in episodes if ep.status is None]
            if not live:
                break
            ids = [np.asarray(ep.ids, dtype=np.int64) for ep in live]
            limits = [min(turn_max, cfg.max_total_tokens - len(x)) for x in ids]
            outputs = self.engine.generate(
                ids, one, derive_seed(seed, turn), self.stop_ids, limits, interrupt
            )
            check(outputs, len(ids), one, self.stop_ids, limits)
            self._advance(live, [outs[0] for outs in outputs], turn)

    def turn_text(self, out: GenerationOutput) -> tuple[str, TurnEnd]:
        """A model turn as its environment sees it: the text without special tokens but with its stop
        string (also when that is a special token), and how the turn ended."""
        text = self.tokenizer.decode(out.response_ids, skip_special_tokens=True)
        last = int(out.response_ids[-1])
        if out.finish_reason != "stop":
            return text, TurnEnd("length")
        if last in self.engine.eos_token_ids:
            return text, TurnEnd("eos")
        stop = self.tokenizer.decode([last], skip_special_tokens=False)
        return (text if text.endswith(stop) else text + stop), TurnEnd("stop", stop)

    def observation_ids(self, turn_ids: list[int], observation: str | list[dict]) -> list[int]:
        """The ids an observation appends after the model turn `turn_ids`: its text tokenised as is, or
        with observation_format='chat' the template's messages (`rollout_workers.chat_turns`). Messages
        with observation_format='text' are a ValueError (the episode fails: nothing renders them)."""
        if self.chat is not None:
            return self.chat(turn_ids, observation, self.turn_stops)
        if not isinstance(observation, str):
            raise ValueError(
                "the environment answered chat messages, but rollout.environment.observation_format='text' "
                "takes text observations: set observation_format='chat'"
            )
        return [int(t) for t in self.tokenizer.encode(observation, add_special_tokens=False)]

    def _advance(self, episodes: list[_Live], outputs: list[GenerationOutput], turn: int) -> None:
        """Append each episode's new model turn, ask the environment, append its observation."""
        for ep, out in zip(episodes, outputs, strict=True):
            ep.ids += [int(t) for t in out.response_ids]
            ep.logprobs += [float(x) for x in out.logprobs]
            if out.versions is not None:
                ep.versions += [int(v) for v in out.versions]
            ep.mask += [1] * len(out.response_ids)
            ep.turn_ends.append(len(ep.ids) - ep.prompt_len - 1)
            ep.turn_rewards.append(float("nan"))
        asking = [(ep, out) for ep, out in zip(episodes, outputs, strict=True) if ep.status is None]
        calls = [
            (lambda ep=ep, text=text, end=end: step_with(self.environment, text, ep.state, end))
            for ep, out in asking
            for text, end in [self.turn_text(out)]
        ]
        for (ep, out), result in zip(asking, self.caller.run(calls), strict=True):
            if not result.ok:
                ep.fail(result)
                continue
            try:
                step = as_step(result.value)
            except (TypeError, ValueError) as err:
                ep.fail(CallResult(error=f"{type(err).__name__}: {err}", seconds=result.seconds))
                continue
            ep.env_s += result.seconds
            ep.info.update(step.info)
            if step.reward is not None:
                ep.turn_rewards[-1] = step.reward
            if step.done:
                ep.status = "done"
                continue
            if turn + 1 >= self.config.max_turns:
                ep.status = "max_turns"
                continue
            try:
                obs = self.observation_ids([int(t) for t in out.response_ids], step.observation)
            except ValueError as err:
                ep.fail(CallResult(error=str(err), seconds=0.0))
                continue
            if len(ep.ids) + len(obs) + 1 > self.config.max_total_tokens:  # no room for obs + one token
                ep.status = "max_tokens"
                continue
            ep.ids += obs
            ep.logprobs += [0.0] * len(obs)
            if ep.versions:
                ep.versions += [ep.versions[-1]] * len(obs)
            ep.mask += [0] * len(obs)
