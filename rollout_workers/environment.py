"""Environments for multi-turn rollouts: the interface, the registry a user's environment joins, and
the episode record (an environment is built by name in `rollout_workers.environments`).

An environment talks to the policy in text. `reset(prompt, meta)` starts an episode and returns its
state; `step(model_turn, state)` takes the text of one model turn and returns what the environment
says back: `(observation, reward, done)`, or a `Step` that also carries counters (`info`, e.g.
`{"tool_calls": 1}`) which the run sums into its `env/*` metrics. The rollout worker owns the tokens:
it decodes each model turn for `step`, tokenises each observation once and appends it, and continues
the next turn from the exact ids so far (`rollout_workers.episodes`).

Rewards: a step's reward (None: none) belongs to the model turn it answered. The last turn's reward is
the episode's outcome (the sample's score with `reward.kind='environment'`; None counts 0); earlier
turns' rewards are placed on the last token of their turn. An environment that raises or does not
answer within `timeout_s` fails the episode: the sample is dropped and counted, never scored.

Register one with `@register_environment("name")` in a module named by `rollout.environment.module`
(a .py file, which the cluster ships to every node, or a dotted module importable on the workers).
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from kernel.registry import Part, Registry

EpisodeStatus = Literal["done", "max_turns", "max_tokens", "env_error", "env_timeout"]
FAILED: frozenset[str] = frozenset({"env_error", "env_timeout"})  # dropped, never scored


@dataclass
class Step:
    """What an environment answers to one model turn."""

    # Appended to the transcript before the next model turn (ignored when done): a text, or chat messages
    # ({"role": "tool" | "user", "content": ...}) rendered by the chat template (observation_format='chat').
    observation: str | list[dict]
    reward: float | None = None  # this turn's reward; on the last turn, the episode's outcome
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)  # counters summed into env/<key> metrics


@dataclass(frozen=True)
class TurnEnd:
    """How a model turn ended: 'eos' (an EOS token), 'stop' (a stop string's token: `stop_text`, which
    the turn's text then ends with) or 'length' (its token limit)."""

    reason: Literal["eos", "stop", "length"]
    stop_text: str | None = None


def step_with(env: Environment, model_turn: str, state: Any, turn_end: TurnEnd | None) -> Any:
    """`env.step(model_turn, state)`, with `turn_end=` as well when one is given and its `step` takes
    that keyword (or **kwargs): environments written without it keep working."""
    if turn_end is not None and _takes_turn_end(type(env).step):
        return env.step(model_turn, state, turn_end=turn_end)
    return env.step(model_turn, state)


@functools.cache
def _takes_turn_end(step: Callable) -> bool:
    params = inspect.signature(step).parameters.values()
    return any(p.name == "turn_end" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class Environment(ABC):
    """One environment instance serves many episodes: per-episode data lives in the state `reset`
    returns, so `step` may run for several episodes at once (from threads)."""

    @abstractmethod
    def reset(self, prompt: str, meta: dict[str, Any]) -> Any:
        """Start an episode for `prompt` (the decoded prompt text) and its data-file `meta`; returns
        the episode's state, handed back to every `step`."""

    @abstractmethod
    def step(self, model_turn: str, state: Any) -> Step | tuple[str, float | None, bool]:
        """Answer one model turn (its text, special tokens such as EOS removed; a stop string kept). A
        `step` that also takes a `turn_end` keyword is told how the turn ended (`TurnEnd`)."""

    def close(self, state: Any) -> None:  # noqa: B027  (optional hook)
        """The episode of `state` has ended (any status): free what it holds. Default: nothing."""


# environments by name (`rollout.environment.name`): registered by `@register_environment`, built with the
# config's `rollout.environment.kwargs`. The same definition registered again (its module run a second
# time, also under another module name: a .py file that is both the environment module and, imported by
# the cluster, the file of `data.tools`) replaces the first; another one under a name is an error.
ENVIRONMENTS: Registry[Part] = Registry("environment", "rollout.environment.name")


def register_environment(name: str) -> Callable[[Callable[..., Environment]], Callable[..., Environment]]:
    """Decorator registering an environment class (or factory) under `name` (`ENVIRONMENTS`)."""
    return ENVIRONMENTS.register(name)


def list_environments() -> list[str]:
    return sorted(ENVIRONMENTS.names())


def environment_factory(name: str) -> Callable[..., Environment]:
    """The class (or factory) registered as `name`, or an error listing the registered ones."""
    return ENVIRONMENTS.function(name)


def as_step(answer: Step | tuple) -> Step:
    """An environment's answer as a `Step`, or a TypeError saying what was wrong with it."""
    if isinstance(answer, Step):
        step = answer
    elif isinstance(answer, tuple) and len(answer) == 3:
        step = Step(*answer)
    else:
        raise TypeError(f"step() must return a Step or (observation, reward, done), got {answer!r}")
    if isinstance(step.observation, list):
        for m in step.observation:
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                raise TypeError(
                    f"step() returned an observation list holding {m!r}: each must be a message "
                    "{'role': str, 'content': str}"
                )
    elif not isinstance(step.observation, str):
        raise TypeError(
            f"step() returned a {type(step.observation).__name__} observation, not a str or a list of messages"
        )
    if step.reward is not None:
        step.reward = float(step.reward)
        if not np.isfinite(step.reward):
            raise ValueError(f"step() returned a non-finite reward {step.reward}")
    step.done = bool(step.done)
    step.info = {str(k): float(v) for k, v in (step.info or {}).items()}
    return step


@dataclass
class Episode:
    """The multi-turn facts of a sample (`Sample.episode`); the sample's `response_ids` are every token
    after the prompt: model turns and observations, in order.

    `loss_mask[i]` is 1 where `response_ids[i]` was sampled by the policy and 0 on observation tokens
    (whose `Sample.logprobs` are 0). `turn_ends[t]` is the index in `response_ids` of turn t's last
    token; `turn_rewards[t]` its reward (NaN: none)."""

    loss_mask: np.ndarray  # uint8 [r]
    turn_ends: np.ndarray  # int64 [turns]
    turn_rewards: np.ndarray  # float32 [turns]
    status: EpisodeStatus
    error: str | None = None
    info: dict[str, float] = field(default_factory=dict)  # the environment's counters, summed
    env_s: float = 0.0  # seconds spent in this episode's environment calls

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def failed(self) -> bool:
        return self.status in FAILED

    @property
    def outcome(self) -> float:
        """The episode's reward: the last turn's (None counts 0)."""
        last = float(self.turn_rewards[-1]) if len(self.turn_rewards) else float("nan")
        return 0.0 if np.isnan(last) else last

    def token_rewards(self) -> np.ndarray:
        """float32 [r]: each earlier turn's reward on its last token (the outcome is the score)."""
        out = np.zeros(len(self.loss_mask), dtype=np.float32)
        for end, r in zip(self.turn_ends[:-1], self.turn_rewards[:-1], strict=True):
            if not np.isnan(r):
                out[int(end)] += float(r)
        return out
