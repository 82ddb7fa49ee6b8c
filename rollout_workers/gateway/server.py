"""The gateway over HTTP (FastAPI served by uvicorn in a thread of the rollout worker's process).

OpenAI's routes, authenticated by a session's key (`Authorization: Bearer <key>`):
    POST /v1/chat/completions   (stream: true answers as server-sent events)
    POST /v1/completions
    GET  /v1/models
The session routes, authenticated by the gateway's admin key (the agent runners hold it; an agent in
another process gets a session from whoever holds it) or, for reward and end, by the session's key:
    POST /sessions                      {prompt_index?, sample_index?, timeout_s?} -> {session_id, api_key, base_url}
    POST /sessions/claim                {wait_s?} -> an offered episode {session_id, api_key, base_url, model,
                                        row, timeout_s}, or 204 with Retry-After when none is offered
                                        within wait_s (`agent.runners: external`, `gateway.claims`)
    POST /sessions/{id}/reward          {reward, completion_id?}
    POST /sessions/{id}/end             {status?: 'done' | 'failed' | 'timeout', error?} -> the session's counts
    GET  /healthz

A streamed answer is generated whole, then sent as chunks (one per token of text, tool calls in one
delta). A client that goes away before it has the whole answer fails its session (`end('failed')`,
counted as `disconnects`): the agent never saw the answer, so the episode is not trained. The gateway
listens for the disconnect while the call waits for the engine (noticed as it happens; the call still
completes and is recorded, then the session ends failed) and while a stream is being sent.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernel.agent_records import AgentTask
from rollout_workers.gateway.gateway import Answer, Gateway
from rollout_workers.gateway.protocol import ChatRequest, CompletionRequest, GatewayError


class _OpenSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_index: int = -1
    sample_index: int = Field(0, ge=0)
    timeout_s: float | None = Field(None, gt=0)


class _Claim(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wait_s: float = Field(0.0, ge=0.0, le=60.0)


class _Reward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float
    completion_id: str | None = None


class _End(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: str = Field("done", pattern="^(done|failed|timeout)$")
    error: str | None = None


def _key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


async def _body(request: Request, model: type[BaseModel]) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GatewayError(400, "the body is not JSON", code="invalid_json") from None
    try:
        return model.model_validate(raw if raw is not None else {})
    except ValidationError as error:
        raise GatewayError.from_validation(error) from None


def build_app(gateway: Gateway, base_url: str) -> FastAPI:
    app = FastAPI(title="rayppo agent gateway", docs_url=None, redoc_url=None)

    @app.exception_handler(GatewayError)
    async def _error(_request: Request, error: GatewayError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    def admin(request: Request) -> None:
        if _key(request) != gateway.admin_key:
            raise GatewayError(401, "the session routes need the gateway's admin key", code="invalid_api_key")

    def session_for(request: Request, session_id: str):
        key = _key(request)
        session = gateway.sessions.get(session_id)
        if session is None:
            raise GatewayError(404, f"no session {session_id}", code="not_found")
        if key not in (gateway.admin_key, session.key):
            raise GatewayError(401, "neither the admin key nor this session's key", code="invalid_api_key")
        return session

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, **gateway.stats()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        if _key(request) != gateway.admin_key:
            gateway.session_of(_key(request))
        return {
            "object": "list",
            "data": [{"id": gateway.model, "object": "model", "created": 0, "owned_by": "rayppo"}],
        }

    @app.post("/sessions")
    async def open_session(request: Request) -> dict:
        admin(request)
        body = await _body(request, _OpenSession)
        gateway.admit()
        session = gateway.open_session(body.prompt_index, body.sample_index, body.timeout_s)
        return {"session_id": session.id, "api_key": session.key, "base_url": base_url + "/v1"}

    @app.post("/sessions/claim")
    async def claim(request: Request):
        admin(request)
        body = await _body(request, _Claim)
        deadline = time.monotonic() + body.wait_s
        while (task := gateway.offers.claim()) is None and time.monotonic() < deadline:
            await asyncio.sleep(CLAIM_POLL_S)
        if task is None:
            return Response(status_code=204, headers={"Retry-After": "1"})
        return JSONResponse(_task_json(task, gateway))

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request) -> dict:
        session = session_for(request, session_id)
        body = await _body(request, _Reward)
        session.set_reward(body.reward, body.completion_id)
        return {"session_id": session_id, "reward": body.reward}

    @app.post("/sessions/{session_id}/end")
    async def end(session_id: str, request: Request) -> dict:
        session = session_for(request, session_id)
        body = await _body(request, _End)
        async with session.lock:  # after the call in flight, if any
            session.end(body.status, body.error)
        return {
            "session_id": session_id,
            "status": session.ended,
            "segments": len(session.segments),
            **session.counts,
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        session = gateway.session_of(_key(request))
        body = await _body(request, ChatRequest)
        answer = await _unless_gone(request, gateway.chat(body, session), session)
        if answer is None:
            return Response(status_code=CLIENT_CLOSED)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return _stream(_chat_chunks(gateway, answer, include_usage), session)
        return JSONResponse(_chat_response(gateway, answer, body.logprobs))  # plain JSON: no encoder walk

    @app.post("/v1/completions")
    async def completions(request: Request):
        session = gateway.session_of(_key(request))
        body = await _body(request, CompletionRequest)
        answer = await _unless_gone(request, gateway.complete(body, session), session)
        if answer is None:
            return Response(status_code=CLIENT_CLOSED)
        if body.stream:
            return _stream(_completion_chunks(answer), session)
        return JSONResponse(_completion_response(answer))

    return app


CLAIM_POLL_S = 0.05


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy scalars and arrays of a parquet row
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON")


def _task_json(task: AgentTask, gateway: Gateway) -> dict:
    """An offered episode as JSON (numpy values of the prompt row as their Python values). A row that is
    not JSON fails its session, named, rather than reaching the agent as something else."""
    try:
        row = json.loads(json.dumps(task.row, default=_plain))
    except (TypeError, ValueError) as error:
        why = f"its prompt row cannot be sent as JSON: {error}"
        gateway.sessions[task.session_id].end("failed", why)
        raise GatewayError(500, f"session {task.session_id}: {why}", code="row_not_json") from None
    return {
        "session_id": task.session_id,
        "api_key": task.api_key,
        "base_url": task.base_url,
        "model": task.model,
        "row": row,
        "timeout_s": task.timeout_s,
    }


GONE = "the client disconnected before it had the answer"
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but the access log says why


def _gone(session) -> None:
    """The client left before it had the whole answer: the agent never saw it."""
    session.counts["disconnects"] += 1
    session.end("failed", GONE)


async def _unless_gone(request: Request, call: Any, session) -> Answer | None:
    """`call`'s answer, or None when the client disconnects meanwhile (the body is read, so the next ASGI
    message is `http.disconnect`). The disconnect is counted at once; the call still runs to its end (its
    tokens are recorded), then the session fails."""
    answer = asyncio.ensure_future(call)
    listen = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait({answer, listen}, return_when=asyncio.FIRST_COMPLETED)
        if not (listen.done() and listen.result().get("type") == "http.disconnect"):
            return await answer
        session.counts["disconnects"] += 1
        await answer
        session.end("failed", GONE)
        return None
    finally:
        listen.cancel()


def _usage(answer: Answer) -> dict:
    completion = sum(len(c.ids) for c in answer.choices)
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": answer.prompt_tokens + completion,
    }


def _openai_calls(message: dict, call_id: str) -> list[dict]:
    return [
        {
            "id": f"call_{call_id[9:]}_{i}",
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
        }
        for i, c in enumerate(message.get("tool_calls") or [])
    ]


def _token_logprobs(gateway: Gateway, ids: list[int], logprobs: list[float]) -> dict:
    content = []
    for t, lp in zip(ids, logprobs, strict=True):
        token = gateway.tokenizer.decode([t])
        content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def _chat_response(gateway: Gateway, answer: Answer, logprobs: bool) -> dict:
    choices = []
    for k, (choice, finish) in enumerate(zip(answer.choices, answer.finish, strict=True)):
        message = choice.message
        calls = _openai_calls(message, choice.completion_id)
        out = {
            "role": "assistant",
            "content": message.get("content") or (None if calls else ""),
            "refusal": None,
        }
        if calls:
            out["tool_calls"] = calls
        choices.append(
            {
                "index": k,
                "message": out,
                "finish_reason": finish,
                "logprobs": _token_logprobs(gateway, choice.ids, choice.logprobs) if logprobs else None,
            }
        )
    return {
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": choices,
        "usage": _usage(answer),
        "system_fingerprint": None,
    }


def _chat_chunks(gateway: Gateway, answer: Answer, include_usage: bool) -> list[dict]:
    def chunk(k: int, delta: dict, finish: str | None = None) -> dict:
        return {
            "id": answer.id,
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.model,
            "choices": [{"index": k, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    chunks = []
    for k, (choice, finish) in enumerate(zip(answer.choices, answer.finish, strict=True)):
        chunks.append(chunk(k, {"role": "assistant", "content": ""}))
        calls = _openai_calls(choice.message, choice.completion_id)
        text = choice.message.get("content") or ""
        for piece in _pieces(gateway, text):
            chunks.append(chunk(k, {"content": piece}))
        if calls:
            chunks.append(chunk(k, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
        chunks.append(chunk(k, {}, finish))
    if include_usage:
        chunks.append(
            {
                "id": answer.id,
                "object": "chat.completion.chunk",
                "created": answer.created,
                "model": answer.model,
                "choices": [],
                "usage": _usage(answer),
            }
        )
    return chunks


def _pieces(gateway: Gateway, text: str) -> list[str]:
    """The text cut where its tokens end; the pieces join to it exactly (else it is one piece)."""
    ids = gateway.tokenizer.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for i in range(1, len(ids) + 1):
        now = gateway.tokenizer.decode(ids[:i])
        if now.startswith(done) and len(now) > len(done):
            pieces.append(now[len(done) :])
            done = now
    return pieces if done == text else [text]


def _completion_response(answer: Answer) -> dict:
    return {
        "id": answer.id.replace("chatcmpl", "cmpl"),
        "object": "text_completion",
        "created": answer.created,
        "model": answer.model,
        "usage": _usage(answer),
        "choices": [
            {"index": k, "text": t, "finish_reason": f, "logprobs": None}
            for k, (t, f) in enumerate(zip(answer.texts, answer.finish, strict=True))
        ],
    }


def _completion_chunks(answer: Answer) -> list[dict]:
    return [
        {
            "id": answer.id.replace("chatcmpl", "cmpl"),
            "object": "text_completion",
            "created": answer.created,
            "model": answer.model,
            "choices": [{"index": k, "text": t, "finish_reason": f, "logprobs": None}],
        }
        for k, (t, f) in enumerate(zip(answer.texts, answer.finish, strict=True))
    ]


def _stream(chunks: list[dict], session) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        sent = False
        try:
            for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
            yield "data: [DONE]\n\n"
            sent = True
        finally:
            if not sent:  # the client went away before the last chunk: the agent never saw the answer
                _gone(session)

    return StreamingResponse(events(), media_type="text/event-stream")


def _loop_factory() -> Any:
    """uvloop's event loop where it is installed (uvicorn's own choice, which `serve` alone skips), else
    asyncio's. uvicorn picks httptools' parser over h11 by itself where that is installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class GatewayServer:
    """Serves a gateway on `host:port` (0: a free port) from a daemon thread; `url` once started."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0) -> None:
        self.gateway = gateway
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # inherited by every connection: without it a response written in two parts waits for the client's
        # delayed ACK (Nagle), 40 ms a call on Linux (measured: /healthz 44 ms -> 0.8 ms)
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._socket.bind((host, port))
        bound_host, bound_port = self._socket.getsockname()[:2]
        shown = socket.gethostbyname(socket.gethostname()) if bound_host == "0.0.0.0" else bound_host
        self.url = f"http://{shown}:{bound_port}"
        app = build_app(gateway, self.url)
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="gateway-http", daemon=True)
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            threading.Event().wait(0.01)
        if not self._server.started:
            raise RuntimeError(f"the gateway did not start on {self.url}")

    def _serve(self) -> None:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(self._server.serve(sockets=[self._socket]))

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.gateway.close()
