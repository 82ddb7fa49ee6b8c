"""AgentRunner: plays agent episodes, each the user's own code against one gateway session.

The user's agent is a function of the prompt row and an openai client whose base URL and API key are
its session's (`client.base_url`, `client.api_key` for code that builds its own client):

    async def agent(row: dict, client: openai.AsyncOpenAI) -> float | None

or a plain `def agent(row, client: openai.OpenAI)`, run in a thread. It returns the episode's reward,
or None when the reward comes from elsewhere (reported over HTTP, `POST /sessions/{id}/reward`, or
scored by the run's reward kind). An agent that raises, returns anything else, or passes its deadline
(`agent.timeout_s`, then cancelled) fails its episode; the outcome says why. The runner never sees a
token: what was sampled is recorded by the gateway.

A plain class with an async `run`; `cluster/` runs it as an async Ray actor, so several workers' calls
run at once on its event loop, each playing its tasks concurrently (at most `sessions_per_runner` per
call).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai

from agent_runners.config import AgentConfig
from kernel.agent_records import AgentOutcome, AgentTask

_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=256)


class _SharedAsyncPool(httpx.AsyncClient):
    """The runner's connection pool, handed to every session's client: an agent that closes its client
    (`async with client:`) must not close the pool under the other sessions."""

    async def aclose(self) -> None:
        return None


class _SharedPool(httpx.Client):
    def close(self) -> None:
        return None


def load_agent(function: str, source: str | None = None) -> Callable:
    """The function 'path.py:name' (run from `source` when given) or 'module:name' names; a ValueError
    naming agent.function when it cannot be loaded or is not callable."""
    target, _, name = function.rpartition(":")
    try:
        if target.endswith(".py"):
            module = types.ModuleType(f"rayppo_agent_{abs(hash((target, source)))}")
            module.__file__ = target
            text = source if source is not None else Path(target).read_text(encoding="utf-8")
            sys.modules[module.__name__] = module
            exec(compile(text, target, "exec"), module.__dict__)
        else:
            module = importlib.import_module(target)
    except Exception as error:
        raise ValueError(
            f"agent.function: cannot load {target!r} ({type(error).__name__}: {error})"
        ) from error
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"agent.function: {target!r} defines no function {name!r}")
    return fn


def as_reward(value: Any) -> float | None:
    """The reward an agent returned: None, or a finite real number (a bool is refused: it is not a score)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"the agent returned {value!r}; return a finite number (its reward) or None")
    return float(value)


class AgentRunner:
    def __init__(self, config: AgentConfig) -> None:
        if not config.enabled:
            raise ValueError("agent.function is not set")
        self.config = config
        self.agent = load_agent(config.function, config.source)  # type: ignore[arg-type]
        self._async = inspect.iscoroutinefunction(self.agent)
        # one connection pool for every session's client (a client of its own would build an SSL context
        # and a pool per episode: most of a runner's CPU at hundreds of episodes a call)
        self._http: httpx.AsyncClient | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._sync_http = _SharedPool(timeout=config.timeout_s, limits=_LIMITS)
        self.calls_in_flight = 0
        self.episodes: dict[str, int] = {"done": 0, "failed": 0, "timeout": 0}  # played, by outcome

    def ping(self) -> bool:
        return True

    def stats(self) -> dict[str, int]:
        return {"calls_in_flight": self.calls_in_flight, **self.episodes}

    async def retire(self, poll_s: float = 0.1) -> dict[str, int]:
        """Return once no `run` call is in flight (a runner scaled away plays its calls to the end; the
        caller then stops the actor); its stats."""
        while self.calls_in_flight:
            await asyncio.sleep(poll_s)
        return self.stats()

    async def run(self, tasks: list[AgentTask]) -> list[AgentOutcome]:
        """Play every task (at most `sessions_per_runner` at once); one outcome per task, in order."""
        slots = asyncio.Semaphore(self.config.sessions_per_runner)

        async def one(task: AgentTask) -> AgentOutcome:
            async with slots:
                return await self.play(task)

        self.calls_in_flight += 1
        try:
            outcomes = await asyncio.gather(*(one(t) for t in tasks))
        finally:
            self.calls_in_flight -= 1
        for outcome in outcomes:
            self.episodes[outcome.status] += 1
        return list(outcomes)

    async def play(self, task: AgentTask) -> AgentOutcome:
        """One episode, its session ended on the gateway with its outcome (reward first)."""
        t0 = time.monotonic()
        try:
            value = await asyncio.wait_for(self._call(task), timeout=task.timeout_s)
            outcome = AgentOutcome(task.session_id, "done", as_reward(value), None, time.monotonic() - t0)
        except TimeoutError:
            why = f"the agent ran past {task.timeout_s:.0f}s"
            outcome = AgentOutcome(task.session_id, "timeout", None, why, time.monotonic() - t0)
        except Exception as error:
            why = f"{type(error).__name__}: {error}"
            outcome = AgentOutcome(task.session_id, "failed", None, why, time.monotonic() - t0)
        await self._close(task, outcome)
        return outcome

    def _pool(self) -> httpx.AsyncClient:
        """The shared pool of the running event loop (a pool is bound to the loop it was made on)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            self._http = _SharedAsyncPool(timeout=self.config.timeout_s, limits=_LIMITS)
            self._http_loop = loop
        return self._http

    async def _close(self, task: AgentTask, outcome: AgentOutcome) -> None:
        """End the session on the gateway as soon as its agent is done (its reward first), so that the
        gateway stops waiting for its calls; the worker ends it again from the outcome if this fails."""
        root = task.base_url.removesuffix("/v1")
        auth = {"Authorization": f"Bearer {task.api_key}"}
        try:
            if outcome.reward is not None:
                await self._pool().post(
                    f"{root}/sessions/{task.session_id}/reward", headers=auth, json={"reward": outcome.reward}
                )
            body = {"status": outcome.status, "error": outcome.error}
            await self._pool().post(f"{root}/sessions/{task.session_id}/end", headers=auth, json=body)
        except httpx.HTTPError:
            pass

    async def _call(self, task: AgentTask) -> Any:
        row = dict(task.row)
        if self._async:
            async with openai.AsyncOpenAI(
                base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=task.timeout_s
            ) as client:
                return await self.agent(row, client)

        def blocking() -> Any:
            with openai.OpenAI(
                base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=task.timeout_s
            ) as client:
                return self.agent(row, client)

        return await asyncio.to_thread(blocking)
