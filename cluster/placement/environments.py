"""Environments as Ray actors of their own (`rollout.environment.placement: actors`), for slow or unsafe
environments: a crash or a hang takes down an environment actor, never a rollout worker.

`EnvironmentHost` holds one environment and the state of every episode started on it. The rollout
workers reach the hosts through `RemoteEnvironment`, an `Environment` whose calls are remote: an episode
stays on the host that started it (round-robin at `reset`). A call that passes `timeout_s` kills its
host, which Ray restarts (`max_restarts=-1`): the episodes it held fail (their state is gone; their next
call fails), the next episodes start on the fresh host. The worker's own per-call deadline still applies.

An episode's key names the host's incarnation (a random id drawn when the host is built, so again at
each restart) and a count: a key from before a restart is never one of the fresh host's episodes, so
its `step` raises (the episode fails) and its `close` does nothing.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any

import ray

from rollout_workers.config import EnvironmentConfig
from rollout_workers.environment import Environment, Step, TurnEnd, as_step, step_with
from rollout_workers.environments import make_environment

# Calls a host runs at once (threads of a threaded actor): every episode of a turn asks at the same time.
HOST_CONCURRENCY = 256

EpisodeKey = tuple[str, int]  # (the host's incarnation, the episode's count on it)


class EnvironmentHost:
    """One environment and its episodes' states (a plain class; run as a threaded Ray actor)."""

    def __init__(self, config: EnvironmentConfig) -> None:
        self.env = make_environment(config.name, config.module, config.kwargs, config.module_source)
        self.states: dict[EpisodeKey, Any] = {}
        self.incarnation = uuid.uuid4().hex  # a restarted host draws a new one
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def ping(self) -> bool:
        return True

    def reset(self, prompt: str, meta: dict) -> EpisodeKey:
        state = self.env.reset(prompt, meta)
        with self._lock:
            key = (self.incarnation, next(self._ids))
            self.states[key] = state
        return key

    def step(self, model_turn: str, key: EpisodeKey, turn_end: TurnEnd | None = None) -> Step:
        if key not in self.states:
            incarnation, number = key
            why = (
                "closed already"
                if incarnation == self.incarnation
                else "the actor restarted since the episode began: its state is gone"
            )
            raise KeyError(f"episode {number} is not on this environment actor ({why})")
        return as_step(step_with(self.env, model_turn, self.states[key], turn_end))

    def close(self, key: EpisodeKey) -> None:
        with self._lock:
            state = self.states.pop(key, None)
        if state is not None:
            self.env.close(state)


class RemoteEnvironment(Environment):
    """The rollout workers' view of the environment hosts (picklable: it holds actor handles)."""

    def __init__(self, hosts: list[Any], timeout_s: float) -> None:
        self.hosts, self.timeout_s = list(hosts), float(timeout_s)
        self._next = itertools.count()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"hosts": self.hosts, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["hosts"], state["timeout_s"])

    def reset(self, prompt: str, meta: dict) -> tuple[Any, EpisodeKey]:
        """Start the episode on the next host round-robin, or on the one after it while that one restarts."""
        with self._lock:
            first = next(self._next)
        order = [self.hosts[(first + k) % len(self.hosts)] for k in range(len(self.hosts))]
        for host in order[:-1]:
            try:
                return host, self._get(host, host.reset.remote(prompt, meta))
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                continue  # restarting or gone: the next one
        return order[-1], self._get(order[-1], order[-1].reset.remote(prompt, meta))

    def step(self, model_turn: str, state: tuple[Any, EpisodeKey], turn_end: TurnEnd | None = None) -> Step:
        host, key = state
        return self._get(host, host.step.remote(model_turn, key, turn_end))

    def close(self, state: tuple[Any, EpisodeKey]) -> None:
        host, key = state
        host.close.remote(key)  # not waited for

    def _get(self, host: Any, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(host, no_restart=False)  # Ray restarts it; the episodes it held fail
            raise TimeoutError(
                f"environment actor did not answer within {self.timeout_s:.0f}s; restarted"
            ) from None
        except (
            ray.exceptions.RayTaskError
        ) as err:  # the environment's own exception, as the worker would see it
            raise err.as_instanceof_cause() from None


def start_environment_hosts(config: EnvironmentConfig, name: Any) -> list[Any]:
    """`config.num_replicas` environment actors (`name(i)` their Ray names), restarted by Ray when they die."""
    actor = ray.remote(EnvironmentHost)
    options = {"num_cpus": config.num_cpus, "max_restarts": -1, "max_concurrency": HOST_CONCURRENCY}
    return [actor.options(name=name(i), **options).remote(config) for i in range(config.num_replicas)]
