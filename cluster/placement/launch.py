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
from cluster.roles.registry import AGENT, LEARNER, REFERENCE, REWARD, ROLLOUT, Place, Role, running

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
    """A run's actors: a pool per scalable role the run runs (`cluster.roles.registry.running`, by name),
    the learner's ranks, and the colocated hosts or environment actors where the config has them."""

    by_role: dict[str, ActorPool]
    plan: PlacementPlan
    ranks: list[Any] = field(default_factory=list)
    hosts: list[Any] = field(default_factory=list)  # cluster.placement='colocated': one per learner rank
    environments: list[Any] = field(default_factory=list)  # rollout.environment.placement='actors'
    groups: dict[str, Any] = field(default_factory=dict)  # actors beside the plan, by group (registry.GROUPS)

    @property
    def agent_runners(self) -> list[Any]:
        """The agent runner actors (agent.function set), or []."""
        group = self.groups.get(AGENT.name)
        return list(group.runners) if group is not None else []

    def group_counts(self) -> dict[str, int]:
        return {name: len(group) for name, group in self.groups.items()}

    def scale_groups(self, targets: dict[str, int]) -> list[str]:
        """Resize the groups to `targets` (between steps); the events. The workers learn of the change."""
        events = []
        for name, group in self.groups.items():
            if name in targets:
                events += group.resize(int(targets[name]), self.workers.handles)
        return events

    @property
    def workers(self) -> ActorPool:
        return self.by_role[ROLLOUT.name]

    @property
    def references(self) -> ActorPool:
        return self.by_role[REFERENCE.name]

    @property
    def scorers(self) -> ActorPool:
        return self.by_role[REWARD.name]

    def pools(self) -> list[ActorPool]:
        return list(self.by_role.values())


def make_pools(
    cfg: RunConfig,
    plan: PlacementPlan,
    run_id: str,
    on_worker_start: Callable[[Any, str], None] | None = None,
) -> Roles:
    """Pools for the scalable roles, placed by `plan`; actors start when the pools grow."""
    hosts, environment = environment_actors(cfg, plan, run_id)
    groups, agents = agent_actors(cfg, run_id)

    def pool(role: Role) -> ActorPool:
        cls = remote_class(role, Place(0, plan.rollout.config, environment, agents=agents()))

        def start(name: str, slot: int) -> Any:
            opts = plan.options(role.name, slot)
            return cls.options(name=actor_name(run_id, name), **opts, **ACTOR_ENV).remote(
                *role.args(cfg, Place(slot, plan.rollout.config, environment, agents=agents()))
            )

        on_start = on_worker_start if role is ROLLOUT else None
        release = functools.partial(plan.release, role.name)
        return ActorPool(role.prefix, start, cfg.timeouts.actor_start_s, on_start, release=release)

    return Roles({role.name: pool(role) for role in running(cfg)}, plan, environments=hosts, groups=groups)


def remote_class(role: Role, place: Place) -> Any:
    """`role`'s actor class as a Ray actor class, with the role's `ray.remote` options."""
    opts = role.remote_options(place)
    return ray.remote(**opts)(role.actor_class()) if opts else ray.remote(role.actor_class())


def environment_actors(cfg: RunConfig, plan: PlacementPlan, run_id: str) -> tuple[list[Any], Any]:
    """With rollout.environment.placement='actors': the environment actors, started now, and the
    `RemoteEnvironment` the rollout workers reach them through; else ([], None)."""
    env = plan.rollout.config.environment  # the workers' section: a module file's text travels in it
    if not (env.enabled and env.placement == "actors"):
        return [], None
    from cluster.placement.environments import RemoteEnvironment, start_environment_hosts

    hosts = start_environment_hosts(env, lambda i: actor_name(run_id, f"environment-{i}"))
    return hosts, RemoteEnvironment(hosts, env.timeout_s)


def agent_actors(cfg: RunConfig, run_id: str) -> tuple[dict[str, Any], Callable[[], Any]]:
    """The groups this run starts beside the plan ({'agent': the runners' `AgentRunners`} with
    agent.function set, started now), and what builds the rollout workers' `Agents` at each worker's
    start (the runners as they are then; `ExternalAgents` with agent.runners='external'; else None)."""
    if not cfg.agent.enabled:
        return {}, lambda: None
    if cfg.agent.runners == "external":
        from rollout_workers.gateway.claims import ExternalAgents

        a = cfg.agent
        external = ExternalAgents(a.timeout_s, a.train_failed, a.model_name)
        return {}, lambda: external
    from cluster.placement.agents import AgentRunners, shipped

    runners = AgentRunners(
        shipped(cfg.agent), lambda i: actor_name(run_id, f"agent-runner-{i}"), cfg.timeouts.actor_start_s
    )
    return {AGENT.name: runners}, runners.view


def start_learner(cfg: RunConfig, roles: Roles, pad_token_id: int, run_id: str) -> None:
    """N ranks in the plan's bundles, joined into one torch.distributed world."""
    cls = remote_class(LEARNER, Place(0))
    names = [LEARNER.member_name(rank) for rank in range(LEARNER.count(cfg))]
    for rank, name in enumerate(names):
        roles.ranks.append(
            cls.options(
                name=actor_name(run_id, name), **roles.plan.options(LEARNER.name, rank), **ACTOR_ENV
            ).remote(*LEARNER.args(cfg, Place(rank, pad_token_id=pad_token_id)))
        )
    form_learner(roles.ranks, names, cfg.timeouts.actor_start_s)


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

    def cannot_start(role: str) -> Callable[[str, int], Any]:
        def start(name: str, slot: int) -> Any:
            raise ActorStartError(
                f"{name}: with cluster.placement='colocated' a {role} lives in a learner rank's process and "
                "is neither replaced nor added on its own; the run stops (continue it with --resume, or use "
                "cluster.placement='separate' for roles that scale and fail independently)"
            )

        return start

    wait = cfg.timeouts.actor_start_s
    roles = Roles({r.name: ActorPool(r.prefix, cannot_start(r.name), wait) for r in running(cfg)}, plan)
    roles.environments, environment = environment_actors(cfg, plan, run_id)
    roles.groups, agents = agent_actors(cfg, run_id)
    try:
        for rank in range(cfg.learner.num_ranks):
            roles.hosts.append(
                ray.remote(ColocatedHost)
                .options(
                    name=actor_name(run_id, LEARNER.member_name(rank)),
                    runtime_env={"env_vars": HOST_ENV},
                    **plan.options(LEARNER.name, rank),
                )
                .remote(rank, cfg, plan.rollout.config, environment=environment, agents=agents())
            )
        roles.ranks = [RoleView(h, LEARNER.name) for h in roles.hosts]
    except BaseException:
        stop_roles(roles)
        raise
    return roles


def finish_colocated(cfg: RunConfig, roles: Roles) -> None:
    """Form the launched hosts' learner world and fill the pools with views of their roles."""
    from cluster.placement.colocated import RoleView

    names = [LEARNER.member_name(rank) for rank in range(len(roles.hosts))]
    form_learner(roles.ranks, names, cfg.timeouts.actor_start_s)
    for role in running(cfg):
        pool = roles.by_role[role.name]
        pool.members = [
            Member(role.member_name(i), RoleView(roles.hosts[i], role.name), i)
            for i in range(role.count(cfg))
        ]


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
        launched = {r.name: roles.by_role[r.name].launch(r.count(cfg)) for r in running(cfg)}
        start_learner(cfg, roles, pad_token_id, run_id)
        for name, started in launched.items():
            roles.by_role[name].admit(started)
    except BaseException:
        stop_roles(roles)
        raise
    return roles


def stop_roles(roles: Roles) -> None:
    for rank in roles.ranks:
        # best effort: the actor is killed next anyway
        with contextlib.suppress(Exception):
            ray.get(rank.shutdown.remote(), timeout=30)
    for actor in [*(roles.hosts or roles.ranks), *roles.environments, *roles.agent_runners]:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    for pool in roles.pools():
        pool.kill_all()
    roles.plan.remove()
