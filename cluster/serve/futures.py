"""The service's futures: every call the SDK makes asynchronously (create_model, forward_backward,
optim_step) is answered at once with a request id and runs as an asyncio task; `/api/v1/retrieve_future`
long-polls it (the SDK's polling contract: `try_again` while it runs, the result, or
`{"error", "category"}` when it failed).

Exactly once. A model's calls carry the SDK's `seq_id` (1, 2, ... per training client) and run in that
order: a call waits for its predecessor (the SDK may send a chunk's calls out of order). The same
`(model_id, seq_id)` sent again (a retry after a dropped connection, whatever its idempotency key), and
for a call without a seq_id the same `X-Idempotency-Key` from the same API key, answer the first call's id:
the work is done once and every copy reads its one result.

Deadlines. A call whose predecessor seq_id has not arrived within `order_wait_s` fails (the SDK resends a
lost call with its seq_id well within that; a client that died leaves the gap for ever), and so does a
call whose work runs past `call_timeout_s`; each failure names the setting that bounds it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

POLL_S = 20.0  # how long one retrieve_future waits before answering try_again (the SDK waits 45 s)


class OrderGap(Exception):
    """A call whose seq_id predecessor never arrived within `order_wait_s` (not applied)."""


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
    given_up: set[int] = dataclasses.field(default_factory=set)  # seq_ids a successor stopped waiting for


class FutureBook:
    def __init__(self, order_wait_s: float = 300.0, call_timeout_s: float = 600.0) -> None:
        self.order_wait_s = order_wait_s
        self.call_timeout_s = call_timeout_s
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
        """Wait until `seq_id`'s predecessor has started, for at most `order_wait_s`."""
        order = self._order.setdefault(model_id, _Order())
        if seq_id in order.given_up:
            raise OrderGap(
                f"call seq_id {seq_id} of {model_id!r} arrived after a later call stopped waiting for it "
                f"({self.order_wait_s:g}s, order_wait_s); it is not applied"
            )
        deadline = time.monotonic() + self.order_wait_s
        while seq_id > order.next_seq:
            event = order.started.setdefault(order.next_seq, asyncio.Event())
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(event.wait(), timeout=max(left, 0.0))
            except TimeoutError:
                missing = order.next_seq
                order.given_up.update(
                    n
                    for n in range(missing, seq_id)
                    if not (n in order.started and order.started[n].is_set())
                )
                order.next_seq = seq_id + 1  # its successors are not held by the same gap
                order.started.setdefault(seq_id, asyncio.Event()).set()
                raise OrderGap(
                    f"call seq_id {seq_id} of {model_id!r} waited {self.order_wait_s:g}s (order_wait_s) for "
                    f"seq_id {missing}, which never arrived; this call is not applied"
                ) from None
        order.next_seq = max(order.next_seq, seq_id + 1)
        order.started.setdefault(seq_id, asyncio.Event()).set()

    async def _run(self, work, model_id, seq_id) -> Done | Failed:
        timer: asyncio.Timeout | None = None
        try:
            if model_id is not None and seq_id is not None:
                await self._turn(model_id, seq_id)
            self.applied += 1
            async with asyncio.timeout(self.call_timeout_s) as timer:
                return await work()
        except OrderGap as e:
            return Failed(str(e), "server")
        except Exception as e:  # the SDK surfaces the message; the service keeps serving
            if timer is not None and timer.expired():
                return Failed(
                    f"the call did not finish within {self.call_timeout_s:g}s (call_timeout_s)", "server"
                )
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
