"""The service's futures: every call the SDK makes asynchronously (create_model, forward_backward,
optim_step) is answered at once with a request id and runs as an asyncio task; `/api/v1/retrieve_future`
long-polls it (the SDK's polling contract: `try_again` while it runs, the result, or
`{"error", "category"}` when it failed).

Exactly once. A model's calls carry the SDK's `seq_id` (1, 2, ... per training client) and run in that
order: a call waits for its predecessor (the SDK may send a chunk's calls out of order). The same
`(model_id, seq_id)` sent again (a retry after a dropped connection, whatever its idempotency key), and
for a call without a seq_id the same `X-Idempotency-Key` from the same API key, answer the first call's id:
the work is done once and every copy reads its one result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

POLL_S = 20.0  # how long one retrieve_future waits before answering try_again (the SDK waits 45 s)


class UserError(ValueError):
    """A request the service refuses (answered with category 'user'; the SDK raises it by message)."""


@dataclasses.dataclass
class Done:
    """A finished call: JSON-able `value`, or protobuf `body` (ForwardBackwardOutput)."""

    value: Any = None
    body: bytes | None = None


@dataclasses.dataclass
class Failed:
    error: str
    category: str  # 'user' | 'server' (the SDK's RequestErrorCategory)


@dataclasses.dataclass
class _Order:
    """A model's seq_id order: the last seq_id started, and an event per seq_id to wake its successor."""

    started: dict[int, asyncio.Event] = dataclasses.field(default_factory=dict)
    next_seq: int = 1


class FutureBook:
    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        self._owner: dict[str, str] = {}  # request id -> API key that made it
        self._by_key: dict[tuple[str, str], str] = {}  # (API key, idempotency key) -> request id
        self._by_seq: dict[tuple[str, int], str] = {}  # (model id, seq id) -> request id
        self._order: dict[str, _Order] = {}
        self.applied = 0  # calls whose work started (a retried call counts once)

    def submit(
        self,
        owner: str,
        work: Callable[[], Awaitable[Done]],
        idempotency_key: str | None = None,
        model_id: str | None = None,
        seq_id: int | None = None,
    ) -> str:
        """The request id of this call: a new task running `work` (after the model's seq_id
        predecessor), or the id of the same call already submitted."""
        ordered = model_id is not None and seq_id is not None
        if ordered:  # the seq_id decides: the SDK's idempotency key is new on each of its own resends
            seen = self._by_seq.get((model_id, seq_id))
        else:
            seen = self._by_key.get((owner, idempotency_key)) if idempotency_key else None
        if seen is not None:
            return seen
        request_id = str(uuid.uuid4())
        self._tasks[request_id] = asyncio.get_running_loop().create_task(self._run(work, model_id, seq_id))
        self._owner[request_id] = owner
        if ordered:
            self._by_seq[(model_id, seq_id)] = request_id
        elif idempotency_key:
            self._by_key[(owner, idempotency_key)] = request_id
        return request_id

    async def _turn(self, model_id: str, seq_id: int) -> None:
        order = self._order.setdefault(model_id, _Order())
        while seq_id > order.next_seq:
            event = order.started.setdefault(order.next_seq, asyncio.Event())
            await event.wait()
        order.next_seq = max(order.next_seq, seq_id + 1)
        order.started.setdefault(seq_id, asyncio.Event()).set()

    async def _run(self, work, model_id, seq_id) -> Done | Failed:
        if model_id is not None and seq_id is not None:
            await self._turn(model_id, seq_id)
        self.applied += 1
        try:
            return await work()
        except Exception as e:  # the SDK surfaces the message; the service keeps serving
            cause = getattr(e, "cause", None) or e  # a Ray task's error carries the actor's exception
            category = "user" if isinstance(cause, ValueError) else "server"
            return Failed(f"{type(cause).__name__}: {cause}", category)

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    async def result(self, request_id: str, wait_s: float = POLL_S) -> Done | Failed | None:
        """The call's outcome, or None while it still runs after `wait_s`."""
        task = self._tasks[request_id]
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        return task.result() if done else None
