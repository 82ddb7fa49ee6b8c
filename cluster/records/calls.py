"""Outstanding remote calls, tracked per actor so that a deadline starts when the work starts.

Ray runs the calls one caller makes on an actor in submission order, one at a time (the roles are
plain, single-threaded actors). A call queued behind others on a busy actor has not started, so its
timeout must not run yet: each actor's calls form a FIFO and only the head's clock runs. When the head
finishes, the next call becomes the head and its clock starts then. A healthy actor with a queue is
never mistaken for a stuck one; a stuck head is found after exactly its own timeout.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import ray

from cluster.records.deadlines import Deadline


@dataclass(eq=False)
class Call:
    ref: Any  # the ObjectRef the call returns (the first one when it returns several)
    actor: str  # name of the actor running it
    kind: (
        str  # what it is: a call kind (`cluster.roles.role.CallKind`, or a role's own), one the tracker takes
    )
    timeout: float  # seconds from the moment the call starts
    payload: Any = None  # the caller's record of the work (e.g. the chunk), for re-dispatch
    started: float | None = None  # monotonic time it reached the head of its actor's queue
    # The caller's bookkeeping, by kind (left at None / 0 by the kinds that have none):
    kept: Any = None  # generate, reference: the second ObjectRef (samples, logprobs), read only by actors
    round: int = 0  # generate, reference, reward: the round of its chunk it belongs to
    check: Callable[[Any], None] | None = None  # prepare: run on the value when it arrives
    chunks: list | None = None  # train: the chunks of the batch this rank trains
    label: str | None = None  # train, export: whose result it is (a rank's name, or "fingerprint")

    @property
    def deadline(self) -> float:
        return float("inf") if self.started is None else self.started + self.timeout


class CallTracker:
    """The calls of one caller. `kinds`: the call kinds it takes (`cluster.roles.registry.call_kinds()`,
    the driver's and the run's roles'); a call of another kind is refused where it is added, naming it,
    so a misspelled kind never becomes a call nobody waits for. None: any kind (a tracker of one test)."""

    def __init__(self, kinds: Collection[str] | None = None) -> None:
        self._queues: dict[str, collections.deque[Call]] = {}
        self._by_ref: dict[Any, Call] = {}
        self._kinds = None if kinds is None else frozenset(kinds)

    def __len__(self) -> int:
        return len(self._by_ref)

    def add(
        self, actor: str, ref: Any, kind: str, timeout: float, payload: Any = None, **bookkeeping
    ) -> Call:
        """Track a call; `bookkeeping` sets `Call`'s bookkeeping fields by name (an unknown one is a TypeError)."""
        if self._kinds is not None and kind not in self._kinds:
            raise ValueError(f"unknown call kind {kind!r}; tracked: {', '.join(sorted(self._kinds))}")
        call = Call(ref, actor, kind, timeout, payload, **bookkeeping)
        queue = self._queues.setdefault(actor, collections.deque())
        if not queue:
            call.started = time.monotonic()
        queue.append(call)
        self._by_ref[ref] = call
        return call

    def pending(self, actor: str, kind: str | None = None) -> int:
        return sum(1 for c in self._queues.get(actor, ()) if kind is None or c.kind == kind)

    def calls(self, kind: str | None = None) -> list[Call]:
        return [c for c in self._by_ref.values() if kind is None or c.kind == kind]

    def _pop(self, call: Call) -> None:
        self._by_ref.pop(call.ref, None)
        queue = self._queues.get(call.actor)
        if not queue:
            return
        was_head = queue[0] is call
        queue.remove(call)
        if was_head and queue and queue[0].started is None:
            queue[0].started = time.monotonic()
        if not queue:
            del self._queues[call.actor]

    def wait(self, idle: Deadline, detail: Callable[[], str] = str, max_wait: float = 1.0) -> list[Call]:
        """Calls that finished (value or error), removed from tracking; waits at most `max_wait` seconds
        or until the earliest running deadline, in slices of a second so Ctrl-C reaches the driver.

        Each tracked call is bounded by its own deadline (`expired`); with nothing tracked nothing can
        finish, and the caller's `idle` deadline runs: past it, a `WaitTimeout` says what the caller
        waited for (`detail()`: what it saw). While calls are tracked it is renewed."""
        if not self._by_ref:
            idle.check(detail)
            time.sleep(min(max_wait, 0.05, idle.left()))
            return []
        idle.renew()
        now = time.monotonic()
        earliest = min((c.deadline for c in self._by_ref.values()), default=now + max_wait)
        timeout = max(0.0, min(max_wait, 1.0, earliest - now))
        # fetch_local=False: readiness only. The default pulls every ready object to the driver's node,
        # samples and weight bundles included; the driver reads only the small values it asks for.
        ready, _ = ray.wait(list(self._by_ref), num_returns=1, timeout=timeout, fetch_local=False)
        if ready:  # collect whatever else is already done, without waiting
            more, _ = ray.wait(
                list(self._by_ref), num_returns=len(self._by_ref), timeout=0, fetch_local=False
            )
            ready = list(dict.fromkeys([*ready, *more]))
        done = [self._by_ref[r] for r in ready]
        for call in done:
            self._pop(call)
        return done

    def expired(self) -> list[Call]:
        """Running calls past their deadline (not removed: the caller decides, usually `drop_actor`)."""
        now = time.monotonic()
        return [q[0] for q in self._queues.values() if q and q[0].deadline <= now]

    def drop_actor(self, actor: str) -> list[Call]:
        """Stop tracking every call of `actor` (it is being replaced); returns them in submission order."""
        calls = list(self._queues.pop(actor, ()))
        for c in calls:
            self._by_ref.pop(c.ref, None)
        return calls


def get_value(call: Call) -> Any:
    """The value of a finished call (raises the call's error, as `ray.get`)."""
    return ray.get(call.ref)
