"""Agent sessions captured token for token: what the policy sampled is trained as it was sampled.

A session is one agent episode. Its calls build *segments*; a segment becomes one training sample (a
multi-turn `Sample` with an `Episode`: loss mask, turn ends, turn rewards), and every segment of a
session shares the session's reward.

The prefix rule. A call *extends* the current segment when its messages are the previous call's
messages, then the assistant message the gateway answered (matched by its content and its tool calls'
names and arguments as objects, so an agent's re-serialised JSON or dropped ids do not matter), then
only new non-assistant messages (tool results, user turns). Its prompt is then the segment's ids so far
(the previous prompt and the completion exactly as sampled) and the new messages rendered by the
policy's chat template as `rollout_workers.chat_turns` renders observations: the policy's own tokens
are never re-tokenised, and the tokens between two completions (template glue, tool results, user
turns) get loss mask 0. Any other call *breaks* the history (the agent dropped, edited or summarised
it, re-sent an assistant message the gateway did not write, or changed its tools), as does every
call after the first when the template fails `check_chat_template` (it rewrites earlier turns, as
Qwen3's drops past reasoning): with `on_history_break='split'` the current segment is closed and a
new one starts from the call's messages rendered in full, with `'refuse'` the call is refused
(`GatewayError`, code `history_rewritten`). Both are counted (`Session.counts`), never merged silently.

With n > 1 choices the next call continues the choice whose message it re-sends; the other choices are
dropped and counted (`unused_choices`); at the session's end its last call's first choice is kept.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from rollout_workers.environment import Episode
from rollout_workers.gateway.protocol import GatewayError
from rollout_workers.types import Sample

HistoryBreak = Literal["split", "refuse"]
SessionEnd = Literal["done", "failed", "timeout"]
_EPISODE_STATUS = {"done": "done", "failed": "env_error", "timeout": "env_timeout"}


def message_key(message: dict[str, Any]) -> tuple:
    """What makes two template-form messages the same message: an assistant's by its text and its tool
    calls' names and argument objects (not their ids, nor the arguments' spelling); any other message
    by all it carries."""
    if message["role"] == "assistant":
        calls = tuple(
            (c["function"]["name"], _canonical(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        )
        return ("assistant", message.get("content") or "", calls)
    return tuple(sorted((k, _canonical(v)) for k, v in message.items()))


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_canonical(v) for v in value)
    return value


@dataclass
class Choice:
    """One sampled completion of a call, before the agent shows which one it continues."""

    completion_id: str
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stopped: bool  # ended on a stop token (EOS or a stop string); False: cut at its token limit
    message: dict[str, Any]  # the assistant message the gateway answered, in template form


@dataclass
class Segment:
    """A token sequence that only grows: the first prompt, then completions and what came between."""

    messages: list[dict[str, Any]]  # the conversation so far in template form, with the last answer
    tools: Any
    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)  # per token after the prompt
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(
        default_factory=list
    )  # index after the prompt of each completion's last token
    completion_ids: list[str] = field(default_factory=list)
    stopped: bool = False
    pending: list[Choice] = field(default_factory=list)  # the last call's choices

    def commit(self, choice: Choice) -> None:
        self.ids += choice.ids
        self.mask += [1] * len(choice.ids)
        self.logprobs += choice.logprobs
        self.versions += choice.versions
        self.turn_ends.append(len(self.ids) - self.prompt_len - 1)
        self.completion_ids.append(choice.completion_id)
        self.messages.append(choice.message)
        self.stopped = choice.stopped
        self.pending = []

    def append_between(self, ids: list[int]) -> None:
        """Tokens the policy did not sample (glue, tool results, user turns): mask 0, logprob 0, the
        version of the token before them."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)


@dataclass
class Prepared:
    """A call's prompt, ready to generate: its ids, and the segment and choice it extends (None: it
    starts a new segment)."""

    prompt: list[int]
    messages: list[dict[str, Any]] | None  # None: a completions call (token ids, no messages)
    tools: Any = None
    extends: Segment | None = None
    chosen: Choice | None = None
    new_messages: list[dict[str, Any]] = field(default_factory=list)


Render = Callable[[list[dict[str, Any]], Any], list[int]]  # (messages, tools) -> prompt ids
Between = Callable[[list[int], list[dict[str, Any]]], list[int]]  # (completion ids, new messages) -> ids


class Session:
    """One agent episode's calls, captured. `render` writes a full prompt; `between` the ids that join a
    completion to the next call's new messages (None: the template cannot be extended token-wise)."""

    def __init__(
        self,
        session_id: str,
        key: str,
        render: Render,
        between: Between | None,
        on_break: HistoryBreak,
        deadline: float,
        prompt_index: int = -1,
        sample_index: int = 0,
    ) -> None:
        self.id, self.key = session_id, key
        self._render, self._between, self._on_break = render, between, on_break
        self.deadline = deadline
        self.prompt_index, self.sample_index = prompt_index, sample_index
        self.segments: list[Segment] = []
        self.reward: float | None = None
        self.completion_rewards: dict[str, float] = {}
        self.ended: SessionEnd | None = None
        self.error: str | None = None
        self.counts: collections.Counter = collections.Counter()
        self.lock = asyncio.Lock()  # a session's calls run one at a time (each extends the one before)

    def prepare(self, messages: list[dict[str, Any]], tools: Any) -> Prepared:
        """The prompt of a call with these template-form messages (the prefix rule, see the module)."""
        self._require_open()
        current = self.segments[-1] if self.segments else None
        if current is None:
            return Prepared(self._render(messages, tools), messages, tools)
        extension = self._extension(current, messages, tools)
        if extension is not None:
            choice, new = extension
            glue = self._between(choice.ids, new)  # type: ignore[misc]
            return Prepared(current.ids + choice.ids + glue, messages, tools, current, choice, new)
        self._history_break("template" if self._between is None else "history")
        return Prepared(self._render(messages, tools), messages, tools)

    def prepare_ids(self, ids: list[int]) -> Prepared:
        """The prompt of a completions call: it extends the segment when its ids start with the segment's
        ids and one of the last call's completions as sampled (no text is re-tokenised)."""
        self._require_open()
        current = self.segments[-1] if self.segments else None
        for choice in current.pending if current else []:
            grown = current.ids + choice.ids
            if len(ids) > len(grown) and ids[: len(grown)] == grown:
                return Prepared(list(ids), None, None, current, choice)
        if current is not None:
            self._history_break("history")
        return Prepared(list(ids), None)

    def _history_break(self, reason: str) -> None:
        self.counts[f"history_breaks_{reason}"] += 1
        if self._on_break == "refuse":
            why = (
                "the policy's chat template rewrites earlier turns, so a session cannot grow token-wise"
                if reason == "template"
                else "the messages are not the previous call's messages, its answer and new non-assistant "
                "messages (history dropped, edited or summarised)"
            )
            raise GatewayError(
                400,
                f"messages: {why}; this run refuses such calls (rollout.gateway.on_history_break='refuse')",
                param="messages",
                code="history_rewritten",
            )

    def _extension(
        self, segment: Segment, messages: list[dict[str, Any]], tools: Any
    ) -> tuple[Choice, list[dict[str, Any]]] | None:
        if self._between is None or _canonical(tools) != _canonical(segment.tools) or not segment.pending:
            return None
        before = segment.messages
        n = len(before)
        if len(messages) <= n + 1 or [message_key(m) for m in messages[:n]] != [
            message_key(m) for m in before
        ]:
            return None
        sent = message_key(messages[n])
        choice = next((c for c in segment.pending if message_key(c.message) == sent), None)
        new = messages[n + 1 :]
        if choice is None or any(m["role"] == "assistant" for m in new):
            return None
        return choice, new

    def record(self, prepared: Prepared, choices: Sequence[Choice]) -> None:
        """Keep a call's choices: on the segment it extended, or on a new one (closing the current)."""
        segment, chosen = prepared.extends, prepared.chosen
        if segment is not None and chosen is not None:
            self.counts["unused_choices"] += len(segment.pending) - 1
            glue_start = len(segment.ids) + len(chosen.ids)
            segment.commit(chosen)
            segment.messages += prepared.new_messages
            segment.append_between(prepared.prompt[glue_start:])
        else:
            if self.segments:
                self._close_segment(self.segments[-1])
            messages = list(prepared.messages or [])
            segment = Segment(messages, prepared.tools, list(prepared.prompt), len(prepared.prompt))
            self.segments.append(segment)
        segment.pending = list(choices)
        self.counts["calls"] += 1
        self.counts["completion_tokens"] += sum(len(c.ids) for c in choices)

    def _close_segment(self, segment: Segment) -> None:
        if segment.pending:
            self.counts["unused_choices"] += len(segment.pending) - 1
            segment.commit(segment.pending[0])

    def set_reward(self, reward: float, completion_id: str | None = None) -> None:
        self._require_open()
        if not math.isfinite(reward):
            raise GatewayError.bad_field("reward", f"must be a finite number, got {reward}")
        if completion_id is None:
            self.reward = float(reward)
            return
        if not any(
            completion_id in (s.completion_ids + [c.completion_id for c in s.pending]) for s in self.segments
        ):
            raise GatewayError(
                404,
                f"completion_id: no completion {completion_id!r} in this session",
                param="completion_id",
                code="not_found",
            )
        self.completion_rewards[completion_id] = float(reward)

    def end(self, status: SessionEnd = "done", error: str | None = None) -> None:
        """Close the session; a second end keeps the first one's status."""
        if self.ended is not None:
            return
        if self.segments:
            self._close_segment(self.segments[-1])
        self.ended, self.error = status, error

    def _require_open(self) -> None:
        if self.ended is not None:
            raise GatewayError(404, f"session {self.id} has ended ({self.ended})", code="session_ended")
        if time.monotonic() > self.deadline:
            self.end("timeout", "the session passed its deadline")
            raise GatewayError(404, f"session {self.id} passed its deadline", code="session_ended")

    def samples(self) -> list[Sample]:
        """The session's segments as training samples (after `end`): each a multi-turn sample whose last
        turn carries the session's reward (None counts 0, as an environment's outcome) and whose earlier
        turns carry their per-completion rewards (NaN: none)."""
        if self.ended is None:
            raise RuntimeError(f"session {self.id} has not ended")
        out = []
        for i, segment in enumerate(self.segments):
            rewards = [self.completion_rewards.get(c, math.nan) for c in segment.completion_ids]
            if rewards:
                rewards[-1] = self.reward if self.reward is not None else rewards[-1]
            model = [v for v, m in zip(segment.versions, segment.mask, strict=True) if m]
            versions = np.asarray(segment.versions, dtype=np.int64)
            episode = Episode(
                loss_mask=np.asarray(segment.mask, dtype=np.uint8),
                turn_ends=np.asarray(segment.turn_ends, dtype=np.int64),
                turn_rewards=np.asarray(rewards, dtype=np.float32),
                status=_EPISODE_STATUS[self.ended],  # type: ignore[arg-type]
                error=self.error,
                # the session's counters once (on its last segment), so that sums over samples count them once
                info={k: float(v) for k, v in self.counts.items()} if i == len(self.segments) - 1 else {},
            )
            out.append(
                Sample(
                    prompt_index=self.prompt_index,
                    prompt_ids=np.asarray(segment.ids[: segment.prompt_len], dtype=np.int64),
                    response_ids=np.asarray(segment.ids[segment.prompt_len :], dtype=np.int64),
                    logprobs=np.asarray(segment.logprobs, dtype=np.float32),
                    finish_reason="stop" if segment.stopped else "length",
                    policy_version=int(min(model)) if model else 0,
                    sample_index=self.sample_index,
                    episode=episode,
                    token_versions=versions if len(set(model)) > 1 else None,
                )
            )
        return out
