"""Pools of interchangeable role actors that can grow, shrink and replace a dead or stuck member.

Every actor gets a readable, never-reused name (`rollout-worker-3`, a replacement of it
`rollout-worker-3.r1`) so the dashboard's Actors view tells the story of a run.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.records.ray_waits import wait_until


class ActorStartError(RuntimeError):
    """An actor did not come up in time; the message names it."""


def wait_ready(handles: list[Any], names: list[str], timeout: float) -> None:
    """Ping every actor; constructor errors (a bad model path, ...) surface with the actor's name."""
    import time

    refs = [h.ping.remote() for h in handles]
    ready, pending = wait_until(refs, len(refs), time.monotonic() + timeout)
    if pending:
        late = [names[refs.index(r)] for r in pending]
        raise ActorStartError(
            f"actors not ready after {timeout:.0f}s (timeouts.actor_start_s): {', '.join(late)}"
        )
    for name, ref in zip(names, refs, strict=True):
        try:
            ray.get(ref)
        except ray.exceptions.RayError as err:
            raise ActorStartError(f"{name} failed to start: {err}") from err


@dataclass
class Member:
    name: str
    handle: Any
    slot: int  # stable index of the logical member (replacements keep it)
    restarts: int = 0


@dataclass
class ActorPool:
    """`start(name, slot)` creates one actor; `on_start(handle, name)` prepares it (e.g. loads weights);
    `release(slot)` is told when a slot's actor is gone for good (scaled down), so its placement
    bundle can go to the next actor started."""

    prefix: str
    start: Callable[[str, int], Any]
    ready_timeout: float
    on_start: Callable[[Any, str], None] | None = None
    release: Callable[[int], None] | None = None
    members: list[Member] = field(default_factory=list)
    replaced: int = 0
    _slots: Any = field(default_factory=itertools.count)
    _rr: int = 0

    def __len__(self) -> int:
        return len(self.members)

    @property
    def handles(self) -> list[Any]:
        return [m.handle for m in self.members]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def _launch(self, names: list[str], slots: list[int]) -> list[Any]:
        handles = [self.start(n, s) for n, s in zip(names, slots, strict=True)]
        wait_ready(handles, names, self.ready_timeout)
        if self.on_start is not None:
            for h, n in zip(handles, names, strict=True):
                self.on_start(h, n)
        return handles

    def launch(self, count: int) -> list[Member]:
        """Start `count` actors without waiting, so several pools can come up at once."""
        slots = [next(self._slots) for _ in range(count)]
        return [Member(f"{self.prefix}-{s}", self.start(f"{self.prefix}-{s}", s), s) for s in slots]

    def admit(self, started: list[Member]) -> list[Member]:
        """Wait for launched actors, prepare them, and add them to the pool."""
        wait_ready([m.handle for m in started], [m.name for m in started], self.ready_timeout)
        if self.on_start is not None:
            for m in started:
                self.on_start(m.handle, m.name)
        self.members.extend(started)
        return started

    def grow(self, count: int) -> list[Member]:
        return self.admit(self.launch(count))

    def shrink(self, count: int) -> list[str]:
        """Remove the newest members (between steps, so they hold no prompts)."""
        gone = self.members[len(self.members) - count :]
        self.members = self.members[: len(self.members) - count]
        for m in gone:
            self._stop(m)
        return [m.name for m in gone]

    def resize(self, target: int) -> tuple[list[str], list[str]]:
        if target < 1:
            raise ValueError(f"{self.prefix}: at least one actor is needed (asked for {target})")
        if target > len(self):
            return [m.name for m in self.grow(target - len(self))], []
        if target < len(self):
            return [], self.shrink(len(self) - target)
        return [], []

    def index_of(self, handle: Any) -> int:
        for i, m in enumerate(self.members):
            if m.handle == handle:
                return i
        raise KeyError(handle)

    def replace(self, index: int) -> Member:
        """Kill (if still alive) and restart the member at `index` under a new name."""
        old = self.members[index]
        with contextlib.suppress(Exception):
            ray.kill(old.handle, no_restart=True)
        restarts = old.restarts + 1
        name = f"{self.prefix}-{old.slot}.r{restarts}"
        (handle,) = self._launch([name], [old.slot])
        self.members[index] = Member(name, handle, old.slot, restarts)
        self.replaced += 1
        return self.members[index]

    def begin_replace(self, index: int) -> Member:
        """Like `replace`, without waiting: the new actor is launched and put in place at once.

        The caller tracks its start (a `ping` call with timeouts.actor_start_s) and prepares it (e.g.
        loads weights) with calls queued before any work, so other results keep being collected
        while it starts. Returns the new member.
        """
        old = self.members[index]
        with contextlib.suppress(Exception):
            ray.kill(old.handle, no_restart=True)
        restarts = old.restarts + 1
        name = f"{self.prefix}-{old.slot}.r{restarts}"
        member = Member(name, self.start(name, old.slot), old.slot, restarts)
        self.members[index] = member
        self.replaced += 1
        return member

    def remove(self, name: str) -> None:
        """Remove and kill one member by name (a drained member during live scaling)."""
        for i, m in enumerate(self.members):
            if m.name == name:
                del self.members[i]
                self._stop(m)
                return
        raise KeyError(name)

    def _stop(self, member: Member) -> None:
        with contextlib.suppress(Exception):
            ray.kill(member.handle, no_restart=True)
        if self.release is not None:
            self.release(member.slot)

    def next(self) -> int:
        """Round-robin index of the member to give the next piece of work."""
        i = self._rr % len(self.members)
        self._rr += 1
        return i

    def kill_all(self) -> None:
        for m in self.members:
            with contextlib.suppress(Exception):
                ray.kill(m.handle, no_restart=True)
        self.members = []
