"""Episodes played by agents outside the cluster (`agent.runners: external`): the worker offers its
sessions on its gateway, an agent anywhere claims one over HTTP (`POST /sessions/claim` with the gateway's
admin key: the session's id, key, base URL, model and prompt row), plays it against the gateway, reports
its reward and ends it (`/sessions/{id}/reward`, `/sessions/{id}/end`).

`ExternalAgents` is the worker's `Agents` for that: `run` offers a generate call's tasks and waits until
every session has ended or passed its deadline (`agent.timeout_s` from when the worker opened it, claim
included). A task nobody claimed by then is withdrawn (it can no longer be claimed) and fails; a claimed
session that was not ended times out. Either way the session's outcome is what the agent said when it
ended it, so the rules downstream (failed episodes dropped and counted, the prompt's exactly-once
accounting) are the runner actors' own.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

from kernel.agent_records import AgentOutcome, AgentTask

POLL_S = 0.05  # how often a waiting worker looks at its sessions


class Offers:
    """The tasks a worker offers and not yet claimed (thread-safe: the worker offers from its actor thread,
    the HTTP loop claims)."""

    def __init__(self) -> None:
        self._tasks: collections.deque[AgentTask] = collections.deque()
        self._lock = threading.Lock()
        self.claimed = 0

    def offer(self, tasks: list[AgentTask]) -> None:
        with self._lock:
            self._tasks.extend(tasks)

    def claim(self) -> AgentTask | None:
        with self._lock:
            if not self._tasks:
                return None
            self.claimed += 1
            return self._tasks.popleft()

    def withdraw(self, session_ids: set[str]) -> set[str]:
        """Take these sessions' tasks off offer; the ids that were still unclaimed."""
        with self._lock:
            gone = {t.session_id for t in self._tasks if t.session_id in session_ids}
            self._tasks = collections.deque(t for t in self._tasks if t.session_id not in session_ids)
            return gone

    def __len__(self) -> int:
        return len(self._tasks)


@dataclass(frozen=True)
class ExternalAgents:
    """The worker's `Agents` when agents outside the cluster play its episodes (picklable: plain fields)."""

    timeout_s: float
    train_failed: bool
    model_name: str

    def run(self, tasks: list[AgentTask], gateway: Any) -> list[AgentOutcome]:
        sessions = [gateway.sessions[t.session_id] for t in tasks]
        gateway.offers.offer(tasks)
        deadline = max((s.deadline for s in sessions), default=0.0)
        while any(s.ended is None for s in sessions) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        unclaimed = gateway.offers.withdraw({t.session_id for t in tasks})
        return [self._outcome(t, s, t.session_id in unclaimed) for t, s in zip(tasks, sessions, strict=True)]

    def _outcome(self, task: AgentTask, session: Any, unclaimed: bool) -> AgentOutcome:
        if unclaimed:
            why = f"no external agent claimed it within agent.timeout_s={self.timeout_s:g}s (POST /sessions/claim)"
            return AgentOutcome(task.session_id, "failed", None, why)
        if session.ended is None:
            why = f"the external agent did not end it within agent.timeout_s={self.timeout_s:g}s"
            return AgentOutcome(task.session_id, "timeout", None, why)
        return AgentOutcome(task.session_id, session.ended, None, session.error)
