"""Colocated placement (a hybrid engine): the roles of a learner rank live in that rank's process.

With `cluster.placement: colocated` the run starts one Ray actor per learner rank, a
`ColocatedHost`, and nothing else. Host i holds learner rank i and, for every role whose count
reaches i, rollout worker i, reference replica i and reward scorer (or judge) i: the demo's four roles run in
one process instead of four (one torch/transformers/DeepSpeed import, one interpreter's memory).
They share the rank's devices and take turns, as the synchronous pipeline does anyway: generate,
score, (rollout engine sleeps), train, (engine wakes), new weights. verl's hybrid engine and
OpenRLHF's `--colocate_all_models` make the same trade.

The roles are the classes the separate placement runs as actors (`cluster.roles.actors`: each role's
plain class with the adapters that keep samples out of the driver), built here as they are there.
The host only runs each call with that role's torch thread count (one process has one thread
setting; as the roles take turns, each may use the learner rank's threads), and moves a new version from the learner to its own worker in memory (`push_local`):
no bundle passes through the object store unless a worker on another host needs it. The driver
reaches every role through a `RoleView`, which the pools, the rollout collector and the weight
push use exactly as an actor handle (`view.generate_chunk.remote(...)`, two references back as from
the actor: the driver reads the facts, the other roles read the samples).

This module imports no role: the host imports them in its own process, so the driver never
imports torch, transformers or DeepSpeed for them.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import ray

from cluster.config.schema import RunConfig
from cluster.roles.registry import BY_NAME, LEARNER, ROLES, ROLLOUT, Place, running
from cluster.roles.startup import starts_without_gc

# The host's environment: quiet transformers, and one OpenMP/BLAS thread for whatever does not take
# its thread count from torch (numpy's BLAS). Ray would set OMP_NUM_THREADS to the host's CPUs
# (all of the roles'): a second BLAS thread then spins against torch's threads, which made every
# role ~20% slower on 2 cores. torch's own threads are set per call, per role.
HOST_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def held_roles(cfg: RunConfig, rank: int) -> tuple[str, ...]:
    """The roles host `rank` holds besides its learner rank: a role's replica i lives on host i."""
    return tuple(role.name for role in running(cfg) if rank < role.count(cfg))


@starts_without_gc  # its roles' imports and builds are its start (cluster.roles.startup)
class ColocatedHost:
    """Learner rank `rank` and the roles `held_roles(cfg, rank)` in one process (a plain class;
    `cluster.placement.launch` runs it as a Ray actor)."""

    def __init__(
        self,
        rank: int,
        cfg: RunConfig,
        worker_config: Any,
        pad_token_id: int | None = None,
        environment: Any = None,
        agents: Any = None,
    ) -> None:
        t0 = time.perf_counter()
        import torch

        classes = {role.name: role.actor_class() for role in ROLES}  # imports the roles' frameworks
        self.timings = {"import_s": time.perf_counter() - t0}
        self._torch = torch
        if pad_token_id is None:  # the driver's rule, on the same tokenizer (it loads it meanwhile)
            from transformers import AutoTokenizer

            from cluster.prompts.loader import pad_token_id as pad_of

            pad_token_id = pad_of(AutoTokenizer.from_pretrained(cfg.tokenizer_path))
        place = Place(rank, worker_config, environment, pad_token_id, agents)
        # The roles take turns, so each may use the threads the learner rank has (at least its own).
        self.threads = {role.name: role.host_threads(cfg) for role in ROLES}
        self._builders = {
            role.name: functools.partial(classes[role.name], *role.args(cfg, place)) for role in ROLES
        }
        self.roles: dict[str, Any] = {}
        # Some roles are built once the learner has joined its world (`call(<learner>, "setup")`,
        # `Role.after_learner_setup`).
        held = held_roles(cfg, rank)
        self._pending = tuple(name for name in held if BY_NAME[name].after_learner_setup)
        for name in (LEARNER.name, *held):
            if name not in self._pending:
                self._build(name)

    def _build(self, role: str) -> None:
        t = time.perf_counter()
        self.roles[role] = self._builders[role]()
        self.timings[f"{role}_s"] = time.perf_counter() - t

    def ping(self) -> bool:
        return True

    def startup_timings(self) -> dict[str, float]:
        """Seconds spent importing the frameworks and building each role (the learner's DeepSpeed
        engine is built later, in `setup`, and the rollout worker right after it)."""
        return dict(self.timings)

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`role.method(*args, **kwargs)` with `role`'s torch thread count."""
        if role in self._pending:
            raise RuntimeError(f"this host builds its {role} after the learner's setup, which has not run")
        if role not in self.roles:
            raise ValueError(f"this host holds {sorted(self.roles)}, not {role!r}")
        self._torch.set_num_threads(self.threads[role])
        t = time.perf_counter()
        out = getattr(self.roles[role], method)(*args, **kwargs)
        if role == LEARNER.name and method == "setup":
            self.timings["learner_setup_s"] = time.perf_counter() - t
            pending, self._pending = self._pending, ()
            for held in pending:
                self._build(held)
        return out

    def push_local(
        self, version: int, describe: Any, share: bool, dtype: str | None = None, probe: bool = True
    ) -> tuple[Any, dict | None, Any]:
        """Export v`version` from this host's learner rank (every rank takes part, as ZeRO-3 gathers)
        and load it into this host's rollout worker in memory (every host wakes its engine first, so
        the driver's loads on other hosts find it awake). Returns (the worker's
        acknowledgement or None, rank 0's fingerprint or None, an object-store copy of the bundle
        when `share`, for workers on other hosts). `probe`: both sides score the probe sequences."""
        self.wake_rollout()
        bundle = self.call(LEARNER.name, "export_weights", describe, dtype, probe)
        meta = self.call(LEARNER.name, "export_fingerprint") if bundle is not None else None
        ack = None
        if bundle is not None and ROLLOUT.name in self.roles:
            ack = self.call(ROLLOUT.name, "load_weights", bundle, version, probe)
        shared = ray.put(bundle) if share and bundle is not None else None
        return ack, meta, shared

    def sleep_rollout(self) -> dict | None:
        """The rollout engine frees its memory for the learner step (a no-op at `rollout.sleep_level` 0)."""
        return self.call(ROLLOUT.name, "sleep") if ROLLOUT.name in self.roles else None

    def wake_rollout(self) -> dict | None:
        """The rollout engine takes its memory back (before new weights are loaded; a no-op when awake)."""
        return self.call(ROLLOUT.name, "wake_up") if ROLLOUT.name in self.roles else None


@dataclass(frozen=True)
class _Method:
    host: Any
    role: str
    name: str

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        two = self.name in BY_NAME[self.role].two_returns  # (fact, payload), as from the role's own actor
        call = self.host.call.options(num_returns=2) if two else self.host.call
        return call.remote(self.role, self.name, *args, **kwargs)


@dataclass(frozen=True)
class RoleView:
    """One role inside a `ColocatedHost`, used like that role's own actor handle."""

    host: Any  # the host's actor handle
    role: str

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self.host, self.role, name)

    @property
    def __ray_call__(self) -> Any:  # a function run in the host's process (e.g. the run-folder probe)
        return self.host.__ray_call__
