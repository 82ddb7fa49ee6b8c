"""The service's warm pool of tenant actors, and admission of a new tenant against the cluster's CPUs.

Warm pool: for each `base_models` entry with `warm: N`, N `TenantModel` actors are started when the
service starts serving (after its `serving <url>` line), each running `TenantModel.load_base` (its
imports done, the base model's weights loaded) and then waiting; each holds `tenant_cpus` of Ray's
CPUs while it waits. The service prints `warm pool <name>: an actor has loaded its base model (<n> so
far)` as each is ready (bench/bench_serve.py waits for those lines). `create_model` takes the oldest
of them (loaded, or still loading: it started before a new one would) and calls `attach` there with
the request's LoRA rank and seed (the serve config's alpha and target modules), which builds its
adapter and DeepSpeed engine: the same calls in the same order as a cold `TenantModel(...)`, so the
same tenant bit for bit. The service prints which way each
tenant started (`tenant <model_id> (...): a warm pool actor` / `a new actor (cold start)`). A
replacement starts at once when the cluster has room for it (`WarmPool.fits`), else when CPUs are
freed (a session's end, `Service.release`). A tenant's restart after its actor died
(`cluster.serve.recovery`) takes a pool actor too when one waits; a pool actor found dead when
taken is logged and replaced by a cold start (`WarmPool.start`). A pooled actor serves one tenant:
when its session ends it is killed like any tenant's (its weights carry the adapter), never returned
to the pool.

Admission: a tenant's actor that Ray cannot place would wait as pending until `start_timeout_s`. A
`create_model` with no pool actor to take is refused at once instead when the cluster's CPUs
(`ray.cluster_resources()`) minus those the service's own actors hold (tenants, pool actors, sampling
engines: `tenant_cpus` each) cannot fit one more `tenant_cpus`. CPUs held by others on a joined
cluster are not counted: such a start can still wait, up to `start_timeout_s`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import ray

from cluster.serve.config import ServeConfig
from cluster.serve.futures import UserError
from learner.config_blocks import LoRAConfig


@dataclasses.dataclass(frozen=True)
class Held:
    """The service's actors that hold `tenant_cpus` each, by kind."""

    tenants: int
    pool: int
    samplers: int

    @property
    def actors(self) -> int:
        return self.tenants + self.pool + self.samplers


def room(cluster_cpus: float, held: Held, tenant_cpus: float) -> bool:
    """Whether one more actor of `tenant_cpus` fits: cluster_cpus - held.actors * tenant_cpus >= tenant_cpus
    (a small epsilon absorbs float sums of fractional CPUs, as Ray's own resource arithmetic rounds)."""
    return cluster_cpus - held.actors * tenant_cpus >= tenant_cpus - 1e-9


def refusal(cluster_cpus: float, held: Held, tenant_cpus: float) -> str:
    """The message of a create_model refused for want of CPUs."""
    free = cluster_cpus - held.actors * tenant_cpus
    return (
        f"create_model refused: no free CPUs for a new tenant (tenant_cpus {tenant_cpus:g}): the Ray "
        f"cluster has {cluster_cpus:g} CPUs and this service holds {held.actors * tenant_cpus:g} of them "
        f"({held.tenants} tenants, {held.pool} warm pool actors, {held.samplers} sampling engines; "
        f"{free:g} free). End a session (ServiceClient close) or serve with a larger cluster or a smaller "
        "tenant_cpus"
    )


class WarmPool:
    """`warm` started `TenantModel` actors per base model name, waiting for a `create_model`."""

    def __init__(self, config: ServeConfig, actor_class: Any, held: Callable[[], Held]) -> None:
        self.config = config
        self.actor_class = actor_class
        self.held = held  # the service's actors now (tenants, this pool, samplers)
        self.waiting: dict[str, list[Any]] = {e.name: [] for e in config.base_models}
        self.starting = 0  # tenants' actors being started or attached (not yet the service's tenants)
        self.loaded = {e.name: itertools.count(1) for e in config.base_models}  # pool actors loaded so far

    def size(self) -> int:
        return sum(len(v) for v in self.waiting.values())

    def refill(self) -> None:
        """Start actors (`load_base` only) up to each base model's `warm` while the cluster has room."""
        for entry in self.config.base_models:
            while len(self.waiting[entry.name]) < entry.warm and self.fits():
                actor = self.actor_class.remote(
                    entry.path, None, 0, self.config.torch_threads, self.config.zero_stage
                )
                self.waiting[entry.name].append(actor)
                actor.loaded.remote().future().add_done_callback(
                    lambda done, name=entry.name: self.announce(name, done)
                )

    def announce(self, base_model: str, done: concurrent.futures.Future) -> None:
        """The service's log line once a pool actor's `load_base` is done (with how many of `base_model`'s
        have, so a reader needs no order among lines), or once it ended before."""
        err = done.exception()
        if err is None:
            n = next(
                self.loaded[base_model]
            )  # itertools.count: atomic under the GIL (Ray's callback threads)
            print(f"warm pool {base_model}: an actor has loaded its base model ({n} so far)", flush=True)
        else:
            print(f"warm pool {base_model}: an actor ended before loading ({type(err).__name__})", flush=True)

    def take(self, base_model: str) -> Any | None:
        """The oldest waiting actor of `base_model` (None if none), a replacement started where it fits."""
        waiting = self.waiting[base_model]
        if not waiting:
            return None
        actor = waiting.pop(0)
        self.refill()
        return actor

    async def start(self, base_model: str, lora: LoRAConfig, seed: int) -> tuple[Any, bool]:
        """A `TenantModel` actor for `base_model` with `lora`'s adapter (init `seed`), loaded (or its load
        error raised) within `start_timeout_s`: a waiting one's (`take`, then `attach` there) or a new
        one's; and whether it was a pool actor. A pool actor found dead (killed, or its load failed)
        is logged and replaced by a cold start, whose own load error (if any) is the one raised."""
        self.starting += 1  # held from here: a pool replacement is placed only if it fits beside it
        try:
            actor = self.take(base_model)
            if actor is not None:
                try:
                    await self._ready(actor, actor.attach.remote(lora, seed))
                    return actor, True
                except ray.exceptions.RayActorError as e:
                    first = str(e).strip().splitlines()[0]
                    print(
                        f"warm pool {base_model}: the actor taken had died ({first}); starting a new one",
                        flush=True,
                    )
            path = self.config.base_model(base_model).path
            actor = self.actor_class.remote(
                path, lora, seed, self.config.torch_threads, self.config.zero_stage
            )
            await self._ready(actor, actor.adapter_digest.remote())
            return actor, False
        finally:
            self.starting -= 1

    async def _ready(self, actor: Any, ready: Any) -> None:
        """Wait for `ready` (the actor's first call) up to `start_timeout_s`; the actor is killed if it fails."""
        try:
            await asyncio.wait_for(ready, self.config.start_timeout_s)
        except TimeoutError:
            ray.kill(actor)
            raise RuntimeError(
                f"the tenant's actor did not start within {self.config.start_timeout_s:g}s "
                f"(start_timeout_s; tenant_cpus {self.config.tenant_cpus:g}; held now: {self.held()})"
            ) from None
        except BaseException:
            ray.kill(actor)  # an actor whose load or attach failed serves no one
            raise

    def fits(self) -> bool:
        return room(cluster_cpus(), self.held(), self.config.tenant_cpus)

    def admit(self) -> None:
        """Raise a `UserError` (module docstring) if a cold start cannot get `tenant_cpus` CPUs."""
        held = self.held()
        cpus = cluster_cpus()
        if not room(cpus, held, self.config.tenant_cpus):
            raise UserError(refusal(cpus, held, self.config.tenant_cpus))


def cluster_cpus() -> float:
    """The Ray cluster's CPUs (its nodes' total, whoever holds them)."""
    return float(ray.cluster_resources().get("CPU", 0.0))
