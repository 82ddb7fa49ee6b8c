"""The agent runners as Ray actors (`agent.function` set), and the rollout workers' view of them.

`start_agent_runners` starts `agent.num_runners` threaded actors (restarted by Ray when they die), the
agent's .py file shipped as text in their config. `RemoteAgents` (picklable: it holds the handles) is
what a rollout worker is built with: `run(tasks)` deals a generate call's sessions over the runners in
equal slices, waits for each slice's outcomes, and turns a runner that died or passed its deadline into
failed or timed-out outcomes for its slice (the sessions fail; a runner past its deadline is killed and
restarted), so one bad runner never loses a chunk. A runner Ray is still restarting is waited for (up to
`RESTART_WAIT_S`) before its slice is dealt, so the call after a death plays on the restarted runner.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Any

import ray

from agent_runners.config import AgentConfig
from agent_runners.runner import AgentRunner
from cluster.placement.pools import wait_ready
from kernel.agent_records import AgentOutcome, AgentTask

RUNNER_CONCURRENCY = 64  # calls one runner serves at once (one per rollout worker asking; async actor)
GRACE_S = 30.0  # a runner's slice deadline beyond its agents' own
RESTART_WAIT_S = 120.0  # how long a call waits for a runner Ray is restarting


def runner_up(runner: Any, within_s: float = RESTART_WAIT_S) -> bool:
    """Whether `runner` answers a ping within `within_s`, waiting while Ray restarts it (a restarting
    actor refuses calls at once with `ActorUnavailableError`; a ping is safe to repeat)."""
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        try:
            ray.get(runner.ping.remote(), timeout=max(0.1, left))
            return True
        except ray.exceptions.ActorUnavailableError:
            if left <= 0:
                return False
            time.sleep(min(0.5, max(0.0, left)))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False


def shipped(config: AgentConfig) -> AgentConfig:
    """`config` with a .py agent file's text in `source` (runners on any node run it without the file)."""
    target = (config.function or "").rpartition(":")[0]
    if not target.endswith(".py") or config.source is not None:
        return config
    path = Path(target)
    if not path.is_file():
        raise ValueError(f"agent.function: file {target!r} does not exist")
    return config.model_copy(update={"source": path.read_text(encoding="utf-8")})


def start_agent_runners(config: AgentConfig, name: Any, slots: range | None = None) -> list[Any]:
    """Runner actors in `slots` (default: the first `num_runners`), named `name(slot)`."""
    actor = ray.remote(AgentRunner)
    options = {"num_cpus": config.num_cpus, "max_restarts": -1, "max_concurrency": RUNNER_CONCURRENCY}
    slots = slots if slots is not None else range(config.num_runners)
    return [actor.options(name=name(i), **options).remote(config) for i in slots]


class AgentRunners:
    """The run's agent runners as a group `cluster.scale agent=K` resizes (`registry.AGENT`), and the
    `RemoteAgents` view of them the rollout workers are built with (`view`).

    Growing starts runners, waits for them, then hands every worker the longer list. Shrinking hands
    the workers the shorter list first, then retires the runners left out: each leaves once the calls
    it is playing end (`AgentRunner.retire`), so no session is cut. Either way a worker gets its new
    list before its next generate call (a caller's calls to an actor run in order)."""

    def __init__(self, config: AgentConfig, name: Any, ready_timeout: float) -> None:
        self.config, self.name, self.ready_timeout = config, name, ready_timeout
        self.runners = start_agent_runners(config, name)
        self.names = [name(i) for i in range(config.num_runners)]
        self.next_slot = config.num_runners
        wait_ready(self.runners, self.names, ready_timeout)

    def view(self) -> RemoteAgents:
        return RemoteAgents(self.runners, self.config)

    def __len__(self) -> int:
        return len(self.runners)

    def resize(self, want: int, workers: list[Any]) -> list[str]:
        """Grow or shrink to `want` runners and tell `workers`; the events (`+name` / `-name`)."""
        if want < 1:
            raise ValueError(f"agent: at least one runner is needed (asked for {want})")
        have = len(self.runners)
        if want == have:
            return []
        gone: list[Any] = []
        if want > have:
            slots = range(self.next_slot, self.next_slot + want - have)
            self.next_slot += len(slots)
            started, names = start_agent_runners(self.config, self.name, slots), [self.name(i) for i in slots]
            wait_ready(started, names, self.ready_timeout)
            self.runners, self.names = self.runners + started, self.names + names
            events = [f"+{n}" for n in names]
        else:
            gone, self.runners = self.runners[want:], self.runners[:want]
            events, self.names = [f"-{n}" for n in self.names[want:]], self.names[:want]
        for worker in workers:
            worker.set_agents.remote(self.view())
        for runner in gone:  # after the workers have the shorter list
            threading.Thread(target=_retire, args=(runner, self.config.timeout_s), daemon=True).start()
        return events


def _retire(runner: Any, within_s: float) -> None:
    """Stop a runner scaled away once its calls are played (or their deadline has passed)."""
    with contextlib.suppress(Exception):
        ray.get(runner.retire.remote(), timeout=within_s + GRACE_S)
    with contextlib.suppress(Exception):
        ray.kill(runner, no_restart=True)


class RemoteAgents:
    """The rollout workers' view of the runners (`rollout_workers.agent_sessions.Agents`)."""

    def __init__(self, runners: list[Any], config: AgentConfig) -> None:
        self.runners = list(runners)
        self.timeout_s, self.train_failed = config.timeout_s, config.train_failed
        self.model_name, self.slots = config.model_name, config.sessions_per_runner

    def run(self, tasks: list[AgentTask], gateway: Any = None) -> list[AgentOutcome]:
        """Deal the tasks over the runners (the gateway's sessions are theirs to call; not read here)."""
        size = math.ceil(len(tasks) / len(self.runners)) if tasks else 0
        slices = [tasks[i : i + size] for i in range(0, len(tasks), size)] if size else []
        calls = [
            (runner, part, runner.run.remote(part) if runner_up(runner) else None)
            for runner, part in zip(self.runners, slices, strict=False)
        ]
        outcomes: list[AgentOutcome] = []
        for runner, part, ref in calls:
            if ref is None:
                why = f"agent runner did not come back within {RESTART_WAIT_S:.0f}s"
                outcomes += [AgentOutcome(t.session_id, "failed", None, why) for t in part]
                continue
            deadline = self.timeout_s * math.ceil(len(part) / self.slots) + GRACE_S
            try:
                outcomes += ray.get(ref, timeout=deadline)
            except ray.exceptions.GetTimeoutError:
                ray.kill(runner, no_restart=False)
                outcomes += [
                    AgentOutcome(
                        t.session_id, "timeout", None, f"agent runner passed {deadline:.0f}s; restarted"
                    )
                    for t in part
                ]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
                why = f"agent runner died: {type(error).__name__}"
                outcomes += [AgentOutcome(t.session_id, "failed", None, why) for t in part]
        return outcomes
