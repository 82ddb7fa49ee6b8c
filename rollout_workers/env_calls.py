"""Environment calls of many episodes at once, each with a deadline that starts when the call starts.

Each batch of calls runs on threads of its own, one per call, so one slow environment delays only its
own episode (up to its timeout), not the batch, and no call waits in a queue behind a stuck one. A call still running `timeout_s` after it started is abandoned: its episode fails as a
time-out. (A thread cannot be killed: a call that never returns keeps its thread; an environment that
can hang belongs in its own process, `rollout.environment.placement='actors'`.)

What an abandoned call returns later is not dropped: it goes to the batch's `late` hook (an episode's
`reset`: the state is closed, `rollout_workers.episodes`), on the call's own thread, and is counted in
`late` and logged. Whether a call finished in time or was abandoned is decided once, under a lock, so
a value is either in the batch's results or handed to `late`, never both nor neither.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class CallResult:
    value: Any = None
    error: str | None = None  # "<ExceptionType>: message" when the call raised
    timed_out: bool = False
    seconds: float = 0.0  # from the call's start to its answer (or to the deadline)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


class EnvCaller:
    """Runs batches of zero-argument calls, each on its own thread, with per-call deadlines."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self.busy_s = 0.0  # seconds spent inside calls, summed over calls
        self.waited_s = 0.0  # seconds the caller waited for a batch
        self.late = 0  # abandoned calls that answered later (their value closed where a batch says how)
        self.late_close_errors = 0  # of those, closes that raised
        self._count = threading.Lock()

    def run(
        self, calls: list[Callable[[], Any]], close_late: Callable[[Any], None] | None = None
    ) -> list[CallResult]:
        """One result per call, in order. What a call abandoned at its deadline returns afterwards is
        handed to `close_late` (on the call's thread; None: dropped), counted in `late` and logged."""
        if not calls:
            return []
        t0 = time.perf_counter()
        starts: list[float | None] = [None] * len(calls)
        ends: list[float | None] = [None] * len(calls)  # set by a call's thread when it answered in time
        abandoned = [False] * len(calls)  # set by the caller at the deadline: the answer comes too late
        lock = threading.Lock()

        def timed(i: int, fn: Callable[[], Any]) -> Any:
            with lock:
                starts[i] = time.perf_counter()
            try:
                value = fn()
            finally:
                with lock:
                    late = abandoned[i]
                    if not late:
                        ends[i] = time.perf_counter()
            if late:
                self._late(value, close_late, time.perf_counter() - starts[i])
            return value

        pool = cf.ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="env")
        futures = [pool.submit(timed, i, fn) for i, fn in enumerate(calls)]
        results: list[CallResult | None] = [None] * len(calls)
        pending = set(range(len(calls)))
        while pending:
            with lock:
                now = time.perf_counter()
                # the earliest deadline among the started calls; queued ones have none yet
                deadlines = [starts[i] + self.timeout_s for i in pending if starts[i] is not None]
            wait = max(0.0, min(deadlines) - now) if deadlines else self.timeout_s
            cf.wait([futures[i] for i in pending], timeout=min(wait, 1.0), return_when=cf.FIRST_COMPLETED)
            with lock:  # each pending call is decided once: answered in time, or abandoned now
                now = time.perf_counter()
                answered = [i for i in pending if ends[i] is not None]
                expired = [
                    i
                    for i in pending
                    if ends[i] is None and starts[i] is not None and now - starts[i] >= self.timeout_s
                ]
                for i in expired:
                    abandoned[i] = True
            for i in answered:  # its thread is returning: the future completes without waiting on anything
                err, took = futures[i].exception(), ends[i] - starts[i]
                results[i] = (
                    CallResult(value=futures[i].result(), seconds=took)
                    if err is None
                    else CallResult(error=f"{type(err).__name__}: {err}", seconds=took)
                )
            for i in expired:
                results[i] = CallResult(timed_out=True, seconds=now - starts[i])  # its thread goes on
            pending -= {*answered, *expired}
        pool.shutdown(wait=False)  # an abandoned call keeps its thread until it returns
        self.waited_s += time.perf_counter() - t0
        self.busy_s += sum(r.seconds for r in results if r is not None)
        return [r for r in results if r is not None]

    def _late(self, value: Any, close: Callable[[Any], None] | None, seconds: float) -> None:
        """An abandoned call's answer, `seconds` after it started: counted, logged, closed."""
        with self._count:
            self.late += 1
        what = "its answer is dropped" if close is None else "what it returned is closed"
        log.warning(
            "rollout.environment: a call answered after %.1fs, past timeout_s=%g (its episode had already "
            "failed as env_timeout): %s",
            seconds,
            self.timeout_s,
            what,
        )
        if close is None:
            return
        try:
            close(value)
        except Exception as err:  # noqa: BLE001 - the thread has no caller left to raise to
            with self._count:
                self.late_close_errors += 1
            log.warning("rollout.environment: closing a late answer raised %s: %s", type(err).__name__, err)
