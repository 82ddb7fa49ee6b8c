"""A tenant of the service (one LoRA training client in a `TenantModel` Ray actor) and its recovery when
that actor dies.

Every call reaches the actor through `Tenant.run`, which tells the actor's death (Ray's `ActorDiedError`:
the process was killed, crashed or ran out of memory) from an error the call itself raised. On a death:

- every call that was in the dead actor, or that reaches the tenant until its recovery ends, fails with
  `TenantLost` (category `server`: the SDK raises `RequestFailedError` with the message and does not
  retry), naming the tenant, the death, and what became of the tenant;
- the first of those calls starts the recovery, which the others wait for: a new actor is started and
  loaded from the tenant's `SavedPoint` — the last `save_state` the client made on it, or the checkpoint
  it was last loaded from (`load_state`, `create_training_client_from_state`), whichever came later —
  with that checkpoint's optimizer state when the save had one (a load without it: a fresh AdamW, as
  the load gave). The failed calls' message names the checkpoint's path and the optim_step it was saved
  after, so the client knows which steps were lost; calls that reach the tenant after the recovery
  apply to the restored state;
- a tenant with no saved point is not re-initialised: it is lost, and each of its calls fails saying so
  and that no state was saved. A new training client (`create_lora_training_client`, same LoRA seed:
  the same initial adapter) is the explicit way to start again; the lost model_id never comes back.
  A recovery that fails (the checkpoint removed since, the actor not starting) leaves the tenant lost
  the same way, naming the failure.

A tenant released with its session (`Service.release` kills its actor) is never recovered: its calls
fail saying its session ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import ray

T = TypeVar("T")


class TenantLost(RuntimeError):
    """A call on a tenant whose actor died (or which was lost or released): not applied."""


@dataclasses.dataclass(frozen=True)
class SavedPoint:
    """The checkpoint a tenant's state last equalled: `path` (tinker://<run>/weights/<name>), the number
    of optim_steps its state had taken, and whether its AdamW state is part of the tenant's state."""

    path: str
    steps: int
    with_optimizer: bool

    def describe(self) -> str:
        opt = (
            "with its optimizer state" if self.with_optimizer else "with a fresh optimizer, as it was loaded"
        )
        return f"checkpoint {self.path!r} (saved after optim_step {self.steps}; {opt})"


@dataclasses.dataclass
class Tenant:
    model_id: str
    owner: str
    session_id: str
    base_model: str
    rank: int
    seed: int  # its LoRA init seed (a recovered actor starts from it, then loads the checkpoint)
    actor: Any  # ray ActorHandle of TenantModel
    saved: SavedPoint | None = None
    lost: str | None = None  # why its calls fail from now on (None: it serves)
    generation: int = 0  # how many actors it has had before this one
    deaths: dict[int, asyncio.Task] = dataclasses.field(default_factory=dict)  # generation -> recovery

    async def call(self, service: Any, method: str, *args: Any) -> Any:
        """`actor.method(*args)`'s result, submitted before the first await (Ray runs one caller's calls
        on an actor in order)."""
        return await self.run(service, lambda actor: getattr(actor, method).remote(*args))

    async def run(self, service: Any, work: Callable[[Any], Awaitable[T]]) -> T:
        """`work(actor)` on the live actor; a `TenantLost` if the tenant is lost, recovering, or its
        actor dies under `work` (then the recovery runs, once per death)."""
        if self.lost is not None:
            raise TenantLost(self.lost)
        recovering = self.deaths.get(self.generation - 1)
        if recovering is not None and not recovering.done():
            raise TenantLost(await asyncio.shield(recovering))
        generation, actor = self.generation, self.actor
        try:
            return await work(actor)
        except ray.exceptions.ActorDiedError as e:
            if e.actor_id not in (None, actor._actor_id.hex()):
                raise  # another actor's death (not this tenant's)
            raise TenantLost(await asyncio.shield(self._died(service, generation, e))) from None

    def _died(self, service: Any, generation: int, error: Exception) -> asyncio.Task:
        """The recovery of the actor of `generation` (started by the first call to see it dead)."""
        if generation not in self.deaths:
            self.generation = generation + 1
            self.deaths[generation] = asyncio.get_running_loop().create_task(recover(service, self, error))
        return self.deaths[generation]


async def recover(service: Any, tenant: Tenant, error: Exception) -> str:
    """Restore `tenant` after its actor died with `error` (module docstring); the message its failed
    calls carry. `service`: `cluster.serve.service.Service` (its checkpoints, sessions and actors)."""
    died = (
        f"tenant {tenant.model_id!r}: its actor died ({type(error).__name__}: {str(error).splitlines()[0]})"
    )
    if service.tenants.get(tenant.model_id) is not tenant:
        tenant.lost = f"{died}; its session had ended ({service.sessions[tenant.session_id].ended})"
        return tenant.lost
    point = tenant.saved
    if point is None:
        tenant.lost = (
            f"{died}. No state was saved for it (save_state) nor loaded into it, so it is lost and not "
            "re-initialised: every call on it fails from now on. Create a new training client to start again"
        )
        return tenant.lost
    try:
        saved = await asyncio.to_thread(
            service.checkpoints.read, tenant.owner, point.path, "weights", "recovery"
        )
        actor = await service.new_actor(tenant.base_model, tenant.rank, tenant.seed)
        try:
            await actor.load_training_state.remote(saved["state"], point.with_optimizer)
        except BaseException:
            ray.kill(actor)
            raise
    except Exception as e:  # noqa: BLE001 - the message names it; the tenant is lost
        tenant.lost = (
            f"{died}. Restoring it from {point.describe()} failed ({type(e).__name__}: {e}): it is lost"
        )
        return tenant.lost
    if service.tenants.get(tenant.model_id) is not tenant:  # its session ended while it was restored
        ray.kill(actor)
        tenant.lost = f"{died}; its session ended while it was restored"
        return tenant.lost
    tenant.actor = actor
    return (
        f"{died}. The service restored it from {point.describe()}: this call was not applied, nor any "
        "other sent since that checkpoint; later calls apply to the restored state"
    )
