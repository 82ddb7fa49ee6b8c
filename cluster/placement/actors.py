"""The role actors on Ray (placed by `cluster.placement`), with readable names for the dashboard's Actors view.

Every actor's Ray name is `<run id>/<member name>` (`actor_name`), e.g.
`sentiment_tiny-20260101-120000/rollout-worker-0.r1`: two runs on one cluster stay apart in the
Actors view (sort or filter by name). The pools keep the short member names for logs and errors.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.config.schema import RunConfig
from cluster.placement.plan import PlacementPlan
from cluster.placement.pools import ActorPool, ActorStartError, Member, wait_ready, wait_until

# Quiet, single-threaded tokenizers and no per-actor progress bars in the driver's log stream.
ACTOR_ENV = {
    "runtime_env": {
        "env_vars": {
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
        }
    }
}


def actor_name(run_id: str, member: str) -> str:
    """The Ray actor name of a run's member: `<run id>/<member>`."""
    return f"{run_id}/{member}"


@dataclass
class Roles:
    workers: ActorPool
    references: ActorPool
    scorers: ActorPool
    plan: PlacementPlan
    ranks: list[Any] = field(default_factory=list)
    hosts: list[Any] = field(default_factory=list)  # cluster.placement='colocated': one per learner rank
    environments: list[Any] = field(default_factory=list)  # rollout.environment.placement='actors'

    def pools(self) -> list[ActorPool]:
        return [self.workers, self.references, self.scorers]


def make_pools(
    cfg: RunConfig,
    plan: PlacementPlan,
    run_id: str,
    on_worker_start: Callable[[Any, str], None] | None = None,
) -> Roles:
    """Pools for the scalable roles, placed by `plan`; actors start when the pools grow."""
    from cluster.placement.role_actors import StreamingReference, StreamingRolloutWorker, StreamingScorer
    from cluster.weights.push import WEIGHTS_GROUP

    ref, rew = cfg.reference, cfg.reward
    temperature = cfg.rollout.sampling.temperature
    wait = cfg.timeouts.actor_start_s

    hosts, environment = environment_actors(cfg, plan, run_id)

    # pipeline.partial_rollout: weight calls get a concurrency group of their own, to run beside a generate call
    worker_cls = (
        ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})(StreamingRolloutWorker)
        if plan.rollout.config.interruptible
        else ray.remote(StreamingRolloutWorker)
    )

    def worker(name: str, slot: int) -> Any:
        return worker_cls.options(
            name=actor_name(run_id, name), **plan.options("rollout", slot), **ACTOR_ENV
        ).remote(cfg.model.policy_path, plan.rollout.config, slot, 0, environment)

    def reference(name: str, slot: int) -> Any:
        return (
            ray.remote(StreamingReference)
            .options(name=actor_name(run_id, name), **plan.options("reference", slot), **ACTOR_ENV)
            .remote(cfg.reference_path, ref, temperature)
        )

    def scorer(name: str, slot: int) -> Any:
        return (
            ray.remote(StreamingScorer)
            .options(name=actor_name(run_id, name), **plan.options("reward", slot), **ACTOR_ENV)
            .remote(rew, cfg.tokenizer_path)
        )

    def pool(role: str, start: Callable[[str, int], Any], on_start: Callable | None = None) -> ActorPool:
        release = functools.partial(plan.release, role)
        return ActorPool(plan.shapes[role].prefix, start, wait, on_start, release=release)

    return Roles(
        workers=pool("rollout", worker, on_worker_start),
        references=pool("reference", reference),
        scorers=pool("reward", scorer),
        plan=plan,
        environments=hosts,
    )


def environment_actors(cfg: RunConfig, plan: PlacementPlan, run_id: str) -> tuple[list[Any], Any]:
    """With rollout.environment.placement='actors': the environment actors, started now, and the
    `RemoteEnvironment` the rollout workers reach them through; else ([], None)."""
    env = plan.rollout.config.environment  # the workers' section: a module file's text travels in it
    if not (env.enabled and env.placement == "actors"):
        return [], None
    from cluster.placement.environments import RemoteEnvironment, start_environment_hosts

    hosts = start_environment_hosts(env, lambda i: actor_name(run_id, f"environment-{i}"))
    return hosts, RemoteEnvironment(hosts, env.timeout_s)


def start_learner(cfg: RunConfig, roles: Roles, pad_token_id: int, run_id: str) -> None:
    """N ranks in the plan's bundles, joined into one torch.distributed world."""
    from cluster.placement.learner_actor import StreamingLearnerRank

    lc = cfg.learner
    wait = cfg.timeouts.actor_start_s
    names = [f"{roles.plan.shapes['learner'].prefix}-{rank}" for rank in range(lc.num_ranks)]
    for rank, name in enumerate(names):
        roles.ranks.append(
            ray.remote(StreamingLearnerRank)
            .options(name=actor_name(run_id, name), **roles.plan.options("learner", rank), **ACTOR_ENV)
            .remote(
                rank,
                lc.num_ranks,
                cfg.model.policy_path,
                lc,
                cfg.run.seed,
                pad_token_id,
                cfg.rollout.sampling.temperature,
            )
        )
    form_learner(roles.ranks, names, wait)


def form_learner(ranks: list[Any], names: list[str], wait: float) -> None:
    """Wait for the started ranks, then join them into one torch.distributed world (DeepSpeed init)."""
    wait_ready(ranks, names, wait)
    addr, port = ray.get(ranks[0].node_address.remote(), timeout=wait)
    setups = [r.setup.remote(addr, port) for r in ranks]
    _, pending = wait_until(setups, len(setups), time.monotonic() + wait)
    if pending:
        raise ActorStartError(f"learner ranks did not form a process group within {wait:.0f}s")
    ray.get(setups)


def launch_colocated(cfg: RunConfig, run_id: str) -> Roles:
    """cluster.placement='colocated': reserve the plan and create one `ColocatedHost` per learner rank
    (named like the rank), without waiting: they import and load while the driver tokenizes. Each
    host holds its rank and replica i of every other role, and finds the pad id itself."""
    from cluster.placement.colocated import HOST_ENV, ColocatedHost, RoleView

    plan = PlacementPlan(cfg)
    plan.reserve()
    prefixes = {role: shape.prefix for role, shape in plan.shapes.items()}

    def cannot_start(role: str) -> Callable[[str, int], Any]:
        def start(name: str, slot: int) -> Any:
            raise ActorStartError(
                f"{name}: with cluster.placement='colocated' a {role} lives in a learner rank's process and "
                "is neither replaced nor added on its own; the run stops (continue it with --resume, or use "
                "cluster.placement='separate' for roles that scale and fail independently)"
            )

        return start

    wait = cfg.timeouts.actor_start_s
    pools = [
        ActorPool(prefixes[role], cannot_start(role), wait) for role in ("rollout", "reference", "reward")
    ]
    roles = Roles(*pools, plan)
    roles.environments, environment = environment_actors(cfg, plan, run_id)
    try:
        for rank in range(cfg.learner.num_ranks):
            roles.hosts.append(
                ray.remote(ColocatedHost)
                .options(
                    name=actor_name(run_id, f"{prefixes['learner']}-{rank}"),
                    runtime_env={"env_vars": HOST_ENV},
                    **plan.options("learner", rank),
                )
                .remote(rank, cfg, plan.rollout.config, environment=environment)
            )
        roles.ranks = [RoleView(h, "learner") for h in roles.hosts]
    except BaseException:
        stop_roles(roles)
        raise
    return roles


def finish_colocated(cfg: RunConfig, roles: Roles) -> None:
    """Form the launched hosts' learner world and fill the pools with views of their roles."""
    from cluster.placement.colocated import RoleView

    plan = roles.plan
    names = [f"{plan.shapes['learner'].prefix}-{rank}" for rank in range(len(roles.hosts))]
    form_learner(roles.ranks, names, cfg.timeouts.actor_start_s)
    counts = (cfg.rollout.num_workers, cfg.reference.num_replicas, cfg.reward.num_replicas)
    for pool, role, count in zip(roles.pools(), ("rollout", "reference", "reward"), counts, strict=True):
        pool.members = [Member(f"{pool.prefix}-{i}", RoleView(roles.hosts[i], role), i) for i in range(count)]


def start_roles(
    cfg: RunConfig, pad_token_id: int, run_id: str, on_worker_start=None, launched: Roles | None = None
) -> Roles:
    """Reserve the whole placement plan first (it fails fast when the cluster cannot hold it), then
    start every actor at once (model loading overlaps); the learner's rendezvous runs meanwhile.
    Colocated: the hosts `launch_colocated` started (`launched`, or started now) are finished."""
    if cfg.cluster.placement == "colocated":
        roles = launched or launch_colocated(cfg, run_id)
        try:
            finish_colocated(cfg, roles)
        except BaseException:
            stop_roles(roles)
            raise
        return roles
    plan = PlacementPlan(cfg)
    plan.reserve()
    roles = make_pools(cfg, plan, run_id, on_worker_start)
    try:
        counts = (cfg.rollout.num_workers, cfg.reference.num_replicas, cfg.reward.num_replicas)
        launched = [pool.launch(n) for pool, n in zip(roles.pools(), counts, strict=True)]
        start_learner(cfg, roles, pad_token_id, run_id)
        for pool, started in zip(roles.pools(), launched, strict=True):
            pool.admit(started)
    except BaseException:
        stop_roles(roles)
        raise
    return roles


def stop_roles(roles: Roles) -> None:
    for rank in roles.ranks:
        # best effort: the actor is killed next anyway
        with contextlib.suppress(Exception):
            ray.get(rank.shutdown.remote(), timeout=30)
    for actor in [*(roles.hosts or roles.ranks), *roles.environments]:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    for pool in roles.pools():
        pool.kill_all()
    roles.plan.remove()
