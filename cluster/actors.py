"""Placement of the role actors on Ray, with readable names for the dashboard's Actors view."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from learner.rank import LearnerRank
from reward_service.reference import ReferencePolicy
from reward_service.scorer import RewardScorer
from rollout_workers.worker import RolloutWorker

from .config import RunConfig


class ActorStartError(RuntimeError):
    """An actor did not come up in time; the message names it."""


@dataclass
class Roles:
    workers: list[Any] = field(default_factory=list)
    references: list[Any] = field(default_factory=list)
    scorers: list[Any] = field(default_factory=list)
    ranks: list[Any] = field(default_factory=list)
    worker_names: list[str] = field(default_factory=list)
    learner_pg: Any = None

    def all_actors(self) -> list[Any]:
        return [*self.workers, *self.references, *self.scorers, *self.ranks]


def _wait_ready(handles: list[Any], names: list[str], timeout: float) -> None:
    refs = [h.ping.remote() for h in handles]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if pending:
        late = [names[refs.index(r)] for r in pending]
        raise ActorStartError(
            f"actors not ready after {timeout:.0f}s (timeouts.actor_start_s): {', '.join(late)}"
        )
    ray.get(ready)  # surfaces constructor errors (bad model path, ...) with the actor's traceback


def start_rollout_worker(cfg: RunConfig, index: int, version: int = 0) -> Any:
    r = cfg.rollout
    return (
        ray.remote(RolloutWorker)
        .options(
            name=f"rollout-worker-{index}",
            num_cpus=r.num_cpus_per_worker,
            num_gpus=r.num_gpus_per_worker,
            max_restarts=0,
        )
        .remote(cfg.model.policy_path, r, index, version)
    )


def start_roles(cfg: RunConfig, pad_token_id: int) -> Roles:
    roles = Roles()
    temperature = cfg.rollout.sampling.temperature
    names: list[str] = []
    for i in range(cfg.rollout.num_workers):
        roles.workers.append(start_rollout_worker(cfg, i))
        roles.worker_names.append(f"rollout-worker-{i}")
    names += roles.worker_names
    ref = cfg.reference
    for i in range(ref.num_replicas):
        roles.references.append(
            ray.remote(ReferencePolicy)
            .options(name=f"reference-{i}", num_cpus=ref.num_cpus, num_gpus=ref.num_gpus)
            .remote(cfg.reference_path, ref, temperature)
        )
        names.append(f"reference-{i}")
    rew = cfg.reward
    for i in range(rew.num_replicas):
        roles.scorers.append(
            ray.remote(RewardScorer)
            .options(name=f"reward-scorer-{i}", num_cpus=rew.num_cpus, num_gpus=rew.num_gpus)
            .remote(rew, cfg.tokenizer_path)
        )
        names.append(f"reward-scorer-{i}")

    lc = cfg.learner
    bundle = {"CPU": lc.num_cpus_per_rank, **({"GPU": lc.num_gpus_per_rank} if lc.num_gpus_per_rank else {})}
    roles.learner_pg = placement_group([dict(bundle) for _ in range(lc.num_ranks)], strategy="PACK")
    try:
        ray.get(roles.learner_pg.ready(), timeout=cfg.timeouts.actor_start_s)
    except ray.exceptions.GetTimeoutError:
        raise ActorStartError(
            f"learner placement group of {lc.num_ranks} x {bundle} not schedulable within "
            f"{cfg.timeouts.actor_start_s:.0f}s: the cluster lacks the resources"
        ) from None
    for rank in range(lc.num_ranks):
        roles.ranks.append(
            ray.remote(LearnerRank)
            .options(
                name=f"learner-rank-{rank}",
                num_cpus=lc.num_cpus_per_rank,
                num_gpus=lc.num_gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=roles.learner_pg, placement_group_bundle_index=rank
                ),
            )
            .remote(rank, lc.num_ranks, cfg.model.policy_path, lc, cfg.run.seed, pad_token_id, temperature)
        )
        names.append(f"learner-rank-{rank}")
    _wait_ready(roles.all_actors(), names, cfg.timeouts.actor_start_s)

    addr, port = ray.get(roles.ranks[0].node_address.remote(), timeout=cfg.timeouts.actor_start_s)
    setups = [r.setup.remote(addr, port) for r in roles.ranks]
    ready, pending = ray.wait(setups, num_returns=len(setups), timeout=cfg.timeouts.actor_start_s)
    if pending:
        raise ActorStartError(
            f"learner ranks did not form a process group within {cfg.timeouts.actor_start_s:.0f}s"
        )
    ray.get(ready)
    return roles


def stop_roles(roles: Roles) -> None:
    for rank in roles.ranks:
        # best effort: the actor is killed next anyway
        with contextlib.suppress(Exception):
            ray.get(rank.shutdown.remote(), timeout=30)
    for actor in roles.all_actors():
        ray.kill(actor, no_restart=True)
    if roles.learner_pg is not None:
        remove_placement_group(roles.learner_pg)
