"""Concurrent calls batched into engine calls: the gateway's requests do not run one by one.

Calls arrive on the server's event loop; one thread owns the engine. When the engine is free it takes
every call waiting, and more while they keep arriving (each within `window_s` of the one before) or
while fewer are waiting than sessions are open (`expected`: a session's agent between two calls), up to
`max_batch` calls and for at most the longer of `_MAX_WINDOWS` windows and `STRAGGLER_SHARE` of the
last engine call's time: sessions answered by one engine call send their next calls milliseconds apart
(tens of them take tens of ms to parse), and a round split over two engine calls costs nearly a second
engine call, so waiting a fraction of one for the stragglers is the cheaper side. It
groups them by what one engine call must share (`BatchKey`: choices per prompt, seed, stop tokens) and
generates each group in one call; calls that arrive meanwhile wait for the next round. A call whose
caller has gone (a client that disconnected) is dropped from its round before it runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rollout_workers.engine import GenerationOutput


@dataclass(frozen=True)
class BatchKey:
    n: int
    seed: int | None
    stop_ids: frozenset[int]


_MAX_WINDOWS = 8  # the longest a round waits for stragglers, in windows, unless engine calls are long
STRAGGLER_SHARE = 0.5  # ... then this share of the last engine call's seconds

# (prompts, key, per-prompt token limits) -> (outputs per prompt, the policy version that produced them)
RunBatch = Callable[[list[np.ndarray], BatchKey, list[int]], tuple[list[list[GenerationOutput]], int]]


@dataclass
class _Call:
    key: BatchKey
    prompt: np.ndarray
    limit: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class Batcher:
    def __init__(
        self, run: RunBatch, window_s: float, max_batch: int, expected: Callable[[], int] = lambda: 0
    ) -> None:
        self._run, self._window, self._max, self._expected = run, window_s, max_batch, expected
        self._queue: queue.Queue[_Call | None] = queue.Queue()
        self.batches = 0  # engine calls made
        self._last_engine_s = 0.0
        self.calls = 0  # gateway calls they served
        self._thread = threading.Thread(target=self._serve, name="gateway-batcher", daemon=True)
        self._thread.start()

    async def generate(
        self, key: BatchKey, prompt: list[int], limit: int
    ) -> tuple[list[GenerationOutput], int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Call(key, np.asarray(prompt, dtype=np.int64), limit, loop, future))
        return await future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _take(self) -> list[_Call] | None:
        first = self._queue.get()
        if first is None:
            return None
        calls = [first]
        cap = time.monotonic() + max(_MAX_WINDOWS * self._window, STRAGGLER_SHARE * self._last_engine_s)
        while len(calls) < self._max:
            # more calls while they keep coming (within a window of the last), or until every open
            # session has one waiting; never past the cap
            waiting_for_more = len(calls) < self._expected()
            try:
                wait = min(self._window, cap - time.monotonic())
                call = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                if waiting_for_more and time.monotonic() < cap:
                    continue
                break
            if call is None:
                self._queue.put(None)  # stop after this round
                break
            calls.append(call)
        return [c for c in calls if not c.future.cancelled()]

    def _serve(self) -> None:
        while (calls := self._take()) is not None:
            groups: dict[BatchKey, list[_Call]] = {}
            for call in calls:
                groups.setdefault(call.key, []).append(call)
            for key, group in groups.items():
                t0 = time.monotonic()
                try:
                    outputs, version = self._run([c.prompt for c in group], key, [c.limit for c in group])
                    results = [(c, (outs, version), None) for c, outs in zip(group, outputs, strict=True)]
                except Exception as error:  # every caller of the failed engine call gets its error
                    results = [(c, None, error) for c in group]
                self._last_engine_s = time.monotonic() - t0
                self.batches += 1
                self.calls += len(group)
                for call, value, error in results:
                    call.loop.call_soon_threadsafe(_settle, call.future, value, error)


def _settle(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():  # its caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
