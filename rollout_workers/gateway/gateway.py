"""The gateway's calls, without HTTP: sessions, prompts rendered by the policy's template, generation
batched into the worker's engine, answers in OpenAI's shapes (the server, `rollout_workers.gateway.server`,
only routes and authenticates).

What a call may ask is what the run trains: the learner recomputes logprobs at the run's sampling
temperature, so a `temperature` or `top_p` other than the run's (`rollout.sampling`) is refused by
name, as are `max_tokens` above the run's `max_new_tokens`, stop strings that are not one token of the
policy's tokenizer, `top_logprobs` (the engines return the sampled token's logprob only), penalties and
response formats. Omitted, they are the run's.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_workers.chat_turns import ChatObservations, chat_observations
from rollout_workers.config import GatewayConfig, SamplingConfig
from rollout_workers.episodes import stop_token_ids
from rollout_workers.gateway.batcher import Batcher, BatchKey, RunBatch
from rollout_workers.gateway.claims import Offers
from rollout_workers.gateway.protocol import ChatRequest, CompletionRequest, GatewayError, Sampling
from rollout_workers.gateway.sessions import Choice, Prepared, Session
from rollout_workers.gateway.tool_calls import CALL_FORMATS
from rollout_workers.types import Sample


@dataclass
class Answer:
    """One call's answer: its choices (with their parsed messages) and token counts, for either shape."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    finish: list[str]
    prompt_tokens: int
    texts: list[str]  # each choice's text as sampled (stop string cut)


class Gateway:
    def __init__(
        self,
        tokenizer: Any,
        model: str,
        sampling: SamplingConfig,
        config: GatewayConfig,
        run: RunBatch,
        eos_ids: frozenset[int],
        max_model_len: int | None,
        template: str | None = None,
        template_kwargs: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer, self.model, self.sampling, self.config = tokenizer, model, sampling, config
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self._kwargs = dict(template_kwargs or {}) | ({"chat_template": template} if template else {})
        self._between, self.template_refusal = self._extender(template, template_kwargs)
        self._parse = CALL_FORMATS[config.call_format]
        self._batcher = Batcher(run, config.batch_window_ms / 1000.0, config.max_batch, self.open_sessions)
        self._clock = clock
        self.admin_key = "gw-admin-" + secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}  # by id
        self.offers = Offers()  # sessions offered to external agents (`agent.runners: external`)
        self._by_key: dict[str, Session] = {}

    def _extender(self, template, kwargs) -> tuple[Callable | None, str | None]:
        """Joins a completion to the next call's new messages, or None (and why) when the template
        cannot be extended token-wise (`rollout_workers.chat_turns.check_chat_template`)."""
        try:
            renderers = {
                r: chat_observations(self.tokenizer, r, self.eos_ids, template, kwargs)
                for r in ("tool", "user")
            }
        except ValueError as refusal:
            return None, str(refusal)
        observe: ChatObservations = renderers["tool"]
        return (lambda ids, messages: observe(ids, messages, self.eos_ids)), None

    # --- sessions ---

    def open_sessions(self) -> int:
        return sum(s.ended is None for s in list(self.sessions.values()))

    def admit(self) -> None:
        """Refuse one more session opened over HTTP past `max_sessions` (429 with Retry-After); the
        worker's own sessions (one per sample of its generate call) are bounded by its chunk."""
        live = sum(s.ended is None for s in self.sessions.values())
        if live >= self.config.max_sessions:
            raise GatewayError(
                429,
                f"{live} sessions are open (rollout.gateway.max_sessions)",
                code="too_many_sessions",
                retry_after=1.0,
            )

    def open_session(
        self, prompt_index: int = -1, sample_index: int = 0, timeout_s: float | None = None
    ) -> Session:
        session = Session(
            "sess-" + uuid.uuid4().hex[:16],
            "gw-" + secrets.token_urlsafe(24),
            self._render,
            self._between,
            self.config.on_history_break,
            self._clock() + (timeout_s or self.config.session_timeout_s),
            prompt_index,
            sample_index,
        )
        self.sessions[session.id] = session
        self._by_key[session.key] = session
        return session

    def session_of(self, key: str | None) -> Session:
        session = self._by_key.get(key or "")
        if session is None:
            raise GatewayError(
                401,
                "no live session has this API key: open a session and use its key",
                code="invalid_api_key",
            )
        return session

    def take(self, session_ids: list[str]) -> list[Sample]:
        """The samples of ended sessions, which the gateway then forgets (each is taken once)."""
        out = []
        for sid in session_ids:
            session = self.sessions.get(sid)
            if session is None or session.ended is None:
                raise KeyError(f"session {sid} is {'unknown' if session is None else 'still open'}")
            out += session.samples()
            del self.sessions[sid], self._by_key[session.key]
        return out

    # --- calls ---

    def _render(self, messages: list[dict], tools: Any) -> list[int]:
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **self._kwargs,
            )
        except Exception as error:  # the template's own refusal (raise_exception) or a missing template
            raise GatewayError.bad_field(
                "messages", f"the policy's chat template cannot render them: {error}"
            ) from None
        return list(rendered["input_ids"])

    def _check(self, request: Sampling, limit: int | None) -> tuple[int | None, frozenset[int]]:
        run = self.sampling
        if request.model != self.model:
            raise GatewayError(
                404,
                f"model {request.model!r} is not served here; this gateway serves {self.model!r}",
                param="model",
                code="model_not_found",
            )
        for name, asked, trained in (
            ("temperature", request.temperature, run.temperature),
            ("top_p", request.top_p, run.top_p),
        ):
            if asked is not None and asked != trained:
                raise GatewayError.bad_field(
                    name, f"this run samples and trains at {name}={trained}; omit it or send {trained}"
                )
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(request, name):
                raise GatewayError.bad_field(
                    name, "penalties change the sampling distribution the run trains on"
                )
        cap = run.max_new_tokens
        if limit is not None and limit > cap:
            raise GatewayError.bad_field(
                "max_tokens", f"at most {cap} (rollout.sampling.max_new_tokens), got {limit}"
            )
        try:
            stops = stop_token_ids(self.tokenizer, request.stops())
        except ValueError as error:
            raise GatewayError.bad_field("stop", str(error).split(": ", 1)[-1]) from None
        return limit, stops

    async def chat(self, request: ChatRequest, session: Session) -> Answer:
        if request.top_logprobs:
            raise GatewayError.bad_field(
                "top_logprobs", "the engines return the sampled token's logprob only"
            )
        if request.response_format and request.response_format.get("type") != "text":
            raise GatewayError.bad_field("response_format", "only {'type': 'text'} is served")
        limit, stops = self._check(request, request.token_limit())
        tools = request.tools or None
        names = request.tool_names() if request.tool_choice != "none" else []
        messages = [m.for_template() for m in request.messages]
        async with session.lock:
            prepared = session.prepare(messages, tools)
            answer = await self._generate(request, prepared, limit, stops)
            self._answer_messages(answer, names, session)
            session.record(prepared, answer.choices)
        return answer

    def _answer_messages(self, answer: Answer, names: list[str], session: Session) -> None:
        for k, (choice, text) in enumerate(zip(answer.choices, answer.texts, strict=True)):
            parsed = self._parse(text, names) if names else None
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if parsed is not None and parsed.calls:
                message["content"] = parsed.content or ""
                message["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.calls
                ]
                answer.finish[k] = "tool_calls"
            session.counts["malformed_tool_calls"] += parsed.malformed if parsed else 0
            choice.message = message

    async def complete(self, request: CompletionRequest, session: Session) -> Answer:
        if request.logprobs:
            raise GatewayError.bad_field("logprobs", "the engines return the sampled token's logprob only")
        if request.echo:
            raise GatewayError.bad_field("echo", "not served")
        limit, stops = self._check(request, request.max_tokens)
        if isinstance(request.prompt, str):
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=False)
        else:
            ids = list(request.prompt)
        async with session.lock:
            prepared = session.prepare_ids(ids)
            answer = await self._generate(request, prepared, limit, stops)
            session.record(prepared, answer.choices)
        return answer

    async def _generate(self, request: Sampling, prepared: Prepared, asked: int | None, stops) -> Answer:
        """Generate a call's choices. Without `max_tokens` a call may take what is left of the session's
        window (rollout.gateway.max_total_tokens, and the model's length), up to the run's max_new_tokens."""
        prompt = prepared.prompt
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise GatewayError.bad_field("prompt", f"token ids must be in [0, {vocab})")
        window = min(x for x in (self.max_model_len, self.config.max_total_tokens) if x is not None)
        room = window - len(prompt)
        limit = asked if asked is not None else min(self.sampling.max_new_tokens, room)
        if limit > room or limit < 1:
            raise GatewayError(
                400,
                f"messages: the prompt is {len(prompt)} tokens and max_tokens {limit}; a session sample holds "
                f"{window} (rollout.gateway.max_total_tokens and the model's length)",
                param="messages",
                code="context_length_exceeded",
            )
        key = BatchKey(request.n, request.seed, stops)
        outputs, version = await self._batcher.generate(key, prompt, limit)
        call_id = "chatcmpl-" + uuid.uuid4().hex[:20]
        choices, texts, finish = [], [], []
        for k, out in enumerate(outputs):
            ids = [int(t) for t in out.response_ids]
            stopped = out.finish_reason == "stop"
            shown = ids[:-1] if stopped else ids  # OpenAI's text omits the EOS and the stop string
            texts.append(self.tokenizer.decode(shown, skip_special_tokens=True))
            versions = [int(v) for v in out.versions] if out.versions is not None else [version] * len(ids)
            choices.append(
                Choice(f"{call_id}-{k}", ids, [float(x) for x in out.logprobs], versions, stopped, {})
            )
            finish.append("stop" if stopped else "length")
        return Answer(call_id, int(time.time()), self.model, choices, finish, len(prompt), texts)

    def close(self) -> None:
        self._batcher.close()

    def stats(self) -> dict[str, float]:
        return {
            "batches": self._batcher.batches,
            "calls": self._batcher.calls,
            "open_sessions": sum(s.ended is None for s in self.sessions.values()),
            "offered": len(self.offers),
            "claimed": self.offers.claimed,
        }
