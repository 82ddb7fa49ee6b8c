"""Environment calls of many episodes at once, each with a deadline that starts when the call starts.

Each batch of calls runs on threads of its own, one per call, so one slow environment delays only its
own episode (up to its timeout), not the batch, and no call waits in a queue behind a stuck one. A call still running `timeout_s` after it started is abandoned: its episode fails as a
time-out. (A thread cannot be killed: a call that never returns keeps its thread; an environment that
can hang belongs in its own process, `rollout.environment.placement='actors'`.)
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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

    def run(self, calls: list[Callable[[], Any]]) -> list[CallResult]:
        t0 = time.perf_counter()
        starts: list[float | None] = [None] * len(calls)
        lock = threading.Lock()

        def timed(i: int, fn: Callable[[], Any]) -> Any:
            with lock:
                starts[i] = time.perf_counter()
            return fn()

        if not calls:
            return []
        pool = cf.ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="env")
        futures = [pool.submit(timed, i, fn) for i, fn in enumerate(calls)]
        results: list[CallResult | None] = [None] * len(calls)
        pending = set(range(len(calls)))
        while pending:
            now = time.perf_counter()
            with lock:
                started = {i: starts[i] for i in pending}
            # the earliest deadline among the started calls; queued ones have none yet
            deadlines = [s + self.timeout_s for s in started.values() if s is not None]
            wait = max(0.0, min(deadlines) - now) if deadlines else self.timeout_s
            cf.wait([futures[i] for i in pending], timeout=min(wait, 1.0), return_when=cf.FIRST_COMPLETED)
            now = time.perf_counter()
            for i in list(pending):
                f, s = futures[i], starts[i]
                if f.done():
                    err = f.exception()
                    took = now - (s if s is not None else now)
                    if err is None:
                        results[i] = CallResult(value=f.result(), seconds=took)
                    else:
                        results[i] = CallResult(error=f"{type(err).__name__}: {err}", seconds=took)
                elif s is not None and now - s >= self.timeout_s:
                    results[i] = CallResult(timed_out=True, seconds=now - s)  # abandoned: the thread goes on
                else:
                    continue
                pending.discard(i)
        pool.shutdown(wait=False)  # an abandoned call keeps its thread until it returns
        self.waited_s += time.perf_counter() - t0
        self.busy_s += sum(r.seconds for r in results if r is not None)
        return [r for r in results if r is not None]
