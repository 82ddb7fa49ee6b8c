"""Who may use a rollout worker's engine, and when a weight load may cut into a generation.

One holder at a time: a generate call, a weight load, a sleep, a fingerprint. A generate call that
lets weights in (`pipeline.partial_rollout`) offers the engine at its interruption points
(`let_loads_in`): a weight load waiting for the engine then runs, and the generation continues after
it. Anything else waits for the holder to finish, as with a plain lock. Pure threading, no Ray: in a
Ray actor the loads arrive on a concurrency group of their own while a generate call runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class WeightGate:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._loads_waiting = 0
        self.cut_ins = 0  # weight loads that ran inside a generation

    @contextlib.contextmanager
    def hold(self, load: bool = False) -> Iterator[None]:
        """Hold the engine until the block ends. A `load` also announces itself, so that a generation
        holding the engine lets it in at its next interruption point."""
        with self._cond:
            if load:
                self._loads_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._held)
            finally:
                if load:
                    self._loads_waiting -= 1
            self._held = True
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def load_due(self) -> bool:
        """A weight load waits for the engine (read by the holder at its interruption points)."""
        return self._loads_waiting > 0

    def let_loads_in(self) -> None:
        """Called by the holder: every weight load waiting now runs before the holder goes on."""
        with self._cond:
            if not self._loads_waiting:
                return
            self._held = False
            self._cond.notify_all()
            # the loads take the engine in turn; the holder takes it back once none waits or holds it
            self._cond.wait_for(lambda: not self._loads_waiting and not self._held)
            self._held = True
            self.cut_ins += 1
