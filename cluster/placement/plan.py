"""One placement plan for every role of a run, reserved before any actor starts.

Every learner rank, rollout worker, reference and reward actor of the configured counts is one
bundle of ONE placement group (strategy PACK), the learner's ranks first. Ray places a group
whole or not at all, so small actors can no longer take, one per node, the room a learner rank
needs. Tensor-parallel vLLM workers on GPUs keep a STRICT_PACK group each (`rollout_placement`),
created and awaited with the rest.

Before anything is created the plan is checked against the nodes' total resources
(`packing.pack`): a plan that no state of this cluster can hold fails at once, naming the bundles
asked for and the free resources per node. A plan that fits an idle cluster waits for busy
resources up to timeouts.actor_start_s, then fails with the same facts. With
`cluster.autoscaling` the check is skipped (new nodes may join for the pending group).

Bundles belong to slots: the replacement of a dead actor takes its slot's bundle again (Ray moves
the bundles of a dead node to live nodes with room, or to a node that joins); a member removed by
scaling gives its bundle back for the next one started; actors started beyond the planned counts
are scheduled by Ray directly with the same resources.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.config.schema import RunConfig
from cluster.placement.packing import PackingUndecided, pack
from cluster.placement.pools import ActorStartError, wait_until
from cluster.placement.rollout_gpus import RolloutPlacement
from cluster.roles.registry import LEARNER, ROLES, ROLLOUT, placed_count

_HIDDEN = ("memory", "object_store_memory")  # node resources no role asks for by name


class PlacementError(ActorStartError):
    """The roles cannot be placed; the message names the bundles and the free resources per node."""


@dataclass(frozen=True)
class RoleShape:
    """What each actor of a role holds, and how many the config starts."""

    prefix: str  # actor names: <prefix>-<slot>
    count: int
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {}), **self.resources}

    def actor_options(self) -> dict[str, Any]:
        extra = {"resources": dict(self.resources)} if self.resources else {}
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **extra}


def role_shapes(cfg: RunConfig) -> dict[str, RoleShape]:
    """Each role's actors as the config places them (`cluster.roles.registry`)."""
    if cfg.cluster.placement == "colocated":
        # One bundle per learner rank holds its host: the rank's devices, which the roles share, and
        # the CPUs of the rank plus those of the roles the busiest host (rank 0) holds.
        own = LEARNER.resources(cfg)
        cpus = sum(role.resources(cfg).num_cpus for role in ROLES if role.runs(cfg))
        return {
            role.name: RoleShape(role.prefix, LEARNER.count(cfg), cpus, own.num_gpus, own.custom)
            if role is LEARNER
            else RoleShape(role.prefix, 0, 0.0, 0.0, {})
            for role in ROLES
        }
    shapes = {}
    for role in ROLES:
        res = role.resources(cfg)
        shapes[role.name] = RoleShape(
            role.prefix, placed_count(role, cfg), res.num_cpus, res.num_gpus, res.custom
        )
    return shapes


def _fmt(amounts: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in amounts.items()) + "}"


def node_resources() -> list[str]:
    """'address id: CPU free/total, ...' for every live node (custom resources included)."""
    from ray._private.state import available_resources_per_node  # DeveloperAPI

    free = available_resources_per_node()
    lines = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        total, avail = node.get("Resources", {}), free.get(node["NodeID"], {})
        shown = [
            f"{k} {avail.get(k, 0.0):g}/{v:g}"
            for k, v in sorted(total.items())
            if k not in _HIDDEN and not k.startswith(("node:", "accelerator_type:")) and "_group_" not in k
        ]
        lines.append(f"{node['NodeManagerAddress']} {node['NodeID'][:8]}: {', '.join(shown) or 'nothing'}")
    return lines


def on_driver_node() -> dict[str, Any]:
    """Actor options that keep a run's own bookkeeping actor (no resources of its own) on the
    driver's node: Ray would put it on any node, and losing that node would end the run."""
    node = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


class PlacementPlan:
    """The bundles of every role, their placement groups, and which slot holds which bundle."""

    def __init__(self, cfg: RunConfig) -> None:
        self.shapes = role_shapes(cfg)
        self.rollout = RolloutPlacement(cfg)
        self.wait_s = cfg.timeouts.actor_start_s
        self.autoscaling = cfg.cluster.autoscaling
        self.group: Any = None
        self.bundles: list[dict[str, float]] = []
        self._free: dict[str, list[int]] = {}  # bundle indices no actor holds, per role
        self._held: dict[tuple[str, int], int] = {}
        for role in (r.name for r in ROLES):  # the registry's order: the learner's ranks first
            if self._own_groups(role):
                continue  # a group of its own per worker
            shape = self.shapes[role]
            self._free[role] = list(range(len(self.bundles), len(self.bundles) + shape.count))
            self.bundles += [shape.bundle() for _ in range(shape.count)]

    def own_groups(self) -> list[list[dict[str, float]]]:
        """The bundles of each STRICT_PACK group (one per tensor-parallel worker slot) made with the plan."""
        if not self.rollout.tensor_parallel_on_gpus:
            return []
        return [self.rollout.bundles() for _ in range(self.shapes[ROLLOUT.name].count)]

    def _own_groups(self, role: str) -> bool:
        """Each actor of `role` has a STRICT_PACK group of its own (tensor-parallel vLLM on GPUs)."""
        return role == ROLLOUT.name and self.rollout.tensor_parallel_on_gpus

    def asked(self) -> str:
        parts = []
        for role in (r.name for r in ROLES):
            shape = self.shapes[role]
            if not shape.count:
                continue  # a role this run does not run
            if self._own_groups(role):
                one = " + ".join(_fmt(b) for b in self.rollout.bundles())
                parts.append(f"{shape.count} x {shape.prefix} [{one} on one node]")
            else:
                parts.append(f"{shape.count} x {shape.prefix} {_fmt(shape.bundle())}")
        return "; ".join(parts)

    def explain(self, problem: str) -> str:
        nodes = "\n".join(f"    {line}" for line in node_resources())
        return (
            f"cannot place the run's roles: {problem}\n"
            f"  asked for: {self.asked()}\n"
            f"  free/total resources per node:\n{nodes}\n"
            "  lower the roles' num_cpus/num_gpus or counts, change their resources "
            f"({', '.join(f'{r.config_section}.resources' for r in ROLES)}), or add nodes "
            "(cluster.autoscaling: true where the cluster adds them itself)"
        )

    def check_fits(self) -> None:
        """Fail at once when no state of the live nodes, all idle, could hold the plan."""
        items = self.bundles + [_sum(bundles) for bundles in self.own_groups()]
        totals = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        try:
            fits = pack(items, totals) is not None
        except PackingUndecided:
            return  # too many combinations to tell: let Ray try
        if not fits:
            raise PlacementError(self.explain("the cluster's nodes cannot hold these bundles even when idle"))

    def reserve(self) -> None:
        """Create every group of the plan and wait until all are placed (or fail, see module doc)."""
        if not self.autoscaling:
            self.check_fits()
        self.group = placement_group(self.bundles, strategy="PACK") if self.bundles else None
        groups = [self.group] if self.group is not None else []
        groups += [self.rollout.group(s) for s in range(len(self.own_groups()))]
        refs = [g.ready() for g in groups]
        _, pending = wait_until(refs, len(refs), time.monotonic() + self.wait_s)
        if pending:
            message = self.explain(
                f"not placed within {self.wait_s:.0f}s (timeouts.actor_start_s): other work holds the "
                "resources, or the nodes that would hold them are gone"
            )
            self.remove()
            raise PlacementError(message)

    def options(self, role: str, slot: int) -> dict[str, Any]:
        """Ray actor options of `role`'s actor in `slot`: its slot's bundle, a free bundle of the
        role, or (beyond the plan) the role's resources scheduled by Ray directly."""
        if self._own_groups(role):
            return self.rollout.options(slot)
        opts = self.shapes[role].actor_options()
        index = self.bundle_index(role, slot)
        if index is not None and self.group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=index
            )
        return opts

    def bundle_index(self, role: str, slot: int) -> int | None:
        """The bundle `role`'s actor in `slot` holds: its own from before (a replacement), else the
        role's first free one, else None (beyond the plan)."""
        key = (role, slot)
        if key not in self._held and self._free.get(role):
            self._held[key] = self._free[role].pop(0)
        return self._held.get(key)

    def release(self, role: str, slot: int) -> None:
        """`role`'s actor in `slot` is gone for good (scaled down): its bundle goes to the next one."""
        index = self._held.pop((role, slot), None)
        if index is not None:
            bisect.insort(self._free[role], index)

    def remove(self) -> None:
        for group in [self.group, *self.rollout.groups.values()]:
            if group is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(group)
        self.group = None
        self.rollout.groups.clear()


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    return dict(sum((collections.Counter(b) for b in bundles), collections.Counter()))


def demand(cfg: RunConfig) -> dict[str, float]:
    """Every resource the plan asks for in all, and the agent runners' CPUs (sizes a local Ray)."""
    plan = PlacementPlan(cfg)
    total = _sum(plan.bundles + [b for group in plan.own_groups() for b in group])
    if cfg.agent.actors:  # actors of their own, outside the plan's bundles
        total["CPU"] = total.get("CPU", 0.0) + cfg.agent.actors * cfg.agent.num_cpus
    return total
