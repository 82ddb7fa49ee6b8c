"""The run's roles, each described once: the learner, the rollout workers, the reference, the reward
scorers and the LLM judge, and the standard reward role of each reward kind whose entry names a role of
its own described nowhere else (`reward_role`: a kind's module and its line in `REWARD_KINDS` add it);
and the groups of actors started beside the plan (the agent runners).

A `Role` says what the rest of cluster/ needs to know of one role: its config section and the name
`cluster.scale` takes (`name`), its actors' names, class and constructor arguments, how many the
config starts and what each holds, the torch threads it takes inside a colocated host, and, for the
roles the rollout collector drives, its `Work`: the call a chunk makes on it, the deadline that call
gets and where its answer is filed on the chunk. Placement (the plan, the pools, the colocated hosts),
control and scaling, the collector and the async stream loop loop over `ROLES` and name no role
themselves (tests/test_layout.py checks that no module of cluster/ but this one spells a role's name).

`ROLES` is a registry of the one type (`kernel.registry`): the roles described here, and any role
described in a module of its own (`cluster.roles.role`'s types), listed by its `"module:Role"` (one
line); such a module then names its role and its call kind itself.

The actor classes are named as `module:Class` and imported only where an actor is built, so the
driver, which reads this registry, never imports torch, transformers or DeepSpeed for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.config.schema import RunConfig
from cluster.records.chunks import Chunk
from cluster.roles.role import (
    DRIVER_KINDS,
    WEIGHTS_GROUP,
    CallKind,
    Place,
    Resources,
    Role,
    Work,
    file_scores,
    scores_filed,
    send_scores,
)
from kernel.registry import Registry
from reward_service.backends import REWARD_KINDS, RewardKind

__all__ = [
    "WEIGHTS_GROUP",
    "CallKind",
    "Place",
    "Resources",
    "Role",
    "Work",
]  # described in cluster.roles.role

# ---------------------------------------------------------------------- the collector's calls


def _send_generate(handle: Any, chunk: Chunk) -> tuple[Any, Any]:
    ps = chunk.prompts
    return handle.generate_chunk.remote(
        [p.index for p in ps],
        [p.ids for p in ps],
        chunk.seed,
        chunk.sampling,
        [p.text for p in ps],
        [p.meta for p in ps],
        [p.messages for p in ps],
    )


def _file_generate(chunk: Chunk, facts: Any, samples: Any) -> None:
    chunk.facts, chunk.samples_ref = facts, samples


def _send_reference(handle: Any, chunk: Chunk) -> tuple[Any, Any]:
    return handle.sample_logprobs.remote(chunk.samples_ref)  # (count, logprobs)


def _file_reference(chunk: Chunk, _count: Any, logprobs: Any) -> None:
    chunk.ref_logprobs_ref = logprobs


# ---------------------------------------------------------------------- the roles

LEARNER = Role(
    name="learner",
    summary="the learner ranks (DeepSpeed), one per rank",
    prefix="learner-rank",
    function="cluster.roles.learner_actor:StreamingLearnerRank",
    count=lambda c: c.learner.num_ranks,
    resources=lambda c: Resources(
        c.learner.num_cpus_per_rank, c.learner.num_gpus_per_rank, c.learner.resources
    ),
    args=lambda c, p: (
        p.slot,
        c.learner.num_ranks,
        c.model.policy_path,
        c.resolved.learner,  # off_policy, lengths, reference_from_base, export_adapter filled in
        c.run.seed,
        p.pad_token_id,
        c.rollout.sampling.temperature,
    ),
    host_threads=lambda c: c.learner.torch_threads,
    two_returns=frozenset({"export_split"}),
    busy_metric="time/train",
)

ROLLOUT = Role(
    name="rollout",
    summary="the rollout workers: generate each chunk's samples",
    prefix="rollout-worker",
    function="cluster.roles.actors:StreamingRolloutWorker",
    count=lambda c: c.rollout.num_workers,
    resources=lambda c: Resources(
        c.rollout.num_cpus_per_worker, c.rollout.num_gpus_per_worker, c.rollout.resources
    ),
    args=lambda c, p: (c.model.policy_path, p.worker_config, p.slot, 0, p.environment, p.agents),
    # the roles of a host take turns, so the worker may use the threads its learner rank has
    host_threads=lambda c: max(c.rollout.torch_threads, c.learner.torch_threads),
    work=Work(
        CallKind.GENERATE,
        "generate_s",
        _send_generate,
        _file_generate,
        lambda ch: ch.facts is not None,
        reads="prompts",
    ),
    scalable=True,
    two_returns=frozenset({"generate_chunk"}),
    # an engine that brings torch.distributed state of its own (vLLM's in-process worker makes a
    # default group of size 1 when none exists, which DeepSpeed would then adopt) must find the
    # learner's world there first
    after_learner_setup=True,
    busy_metric="time/generate",
    # pipeline.partial_rollout: weight calls get a concurrency group of their own, to run beside a generate call
    remote_options=lambda p: (
        {"concurrency_groups": {WEIGHTS_GROUP: 1}} if p.worker_config.interruptible else {}
    ),
)

REFERENCE = Role(
    name="reference",
    summary="the reference policy replicas: the samples' reference logprobs",
    prefix="reference",
    function="cluster.roles.actors:StreamingReference",
    count=lambda c: c.reference.num_replicas,
    resources=lambda c: Resources(c.reference.num_cpus, c.reference.num_gpus, c.reference.resources),
    args=lambda c, p: (c.reference_path, c.resolved.reference, c.rollout.sampling.temperature),
    host_threads=lambda c: c.learner.torch_threads,  # the separate placement's reference uses 1
    work=Work(
        CallKind.REFERENCE,
        "score_s",
        _send_reference,
        _file_reference,
        lambda ch: ch.ref_logprobs_ref is not None,
        on_eval=False,
    ),
    scalable=True,
    two_returns=frozenset({"sample_logprobs"}),
    path_fields=("model_path",),
    # reference.source='policy_base': the learner ranks compute it (the base weights, LoRA adapters off)
    runs=lambda c: c.resolved.reference_source == "actors",
)

REWARD = Role(
    name="reward",
    summary="the reward scorers: the samples' rewards, by the reward kind's backend",
    prefix="reward-scorer",
    function="cluster.roles.actors:StreamingScorer",
    count=lambda c: c.reward.num_replicas,
    resources=lambda c: Resources(c.reward.num_cpus, c.reward.num_gpus, c.reward.resources),
    args=lambda c, p: (c.scorer_reward, c.tokenizer_path),  # function_timeout_s resolved
    host_threads=lambda c: c.learner.torch_threads,
    work=Work(CallKind.REWARD, "score_s", send_scores, file_scores, scores_filed),
    scalable=True,
    busy_metric="time/score",
    path_fields=("model_path",),
    runs=lambda c: REWARD_KINDS[c.reward.kind].own_role is None,  # else a role of its own scores instead
)


def reward_role(kind: RewardKind, **described: Any) -> Role:
    """The role that scores a reward kind whose entry names a role of its own (`own_role`): the scorer's
    contract (a ScoreBatch per chunk, filed as the chunk's scores) with the kind's backend as its only
    one, its actors counted and sized by the kind's section (`reward.<kind>`: `RoleSection`'s fields),
    scalable (`cluster.scale <role>=K`), running when the run's kind names it. `described` replaces the
    standard parts (the judge's actor class builds its engine's model)."""
    name = kind.own_role
    assert name is not None, kind.name

    def section(c: RunConfig) -> Any:
        return getattr(c.reward, kind.name)

    standard = Role(
        name=name,
        summary=f"the rewards of reward.kind={kind.name!r}, by actors of their own",
        prefix=f"reward-{name}",
        function="cluster.roles.actors:StreamingScorer",
        count=lambda c: section(c).num_replicas,
        resources=lambda c: Resources(section(c).num_cpus, section(c).num_gpus, section(c).resources),
        args=lambda c, p: (c.scorer_reward, c.tokenizer_path),  # function_timeout_s resolved
        host_threads=lambda c: c.learner.torch_threads,
        work=Work(name, "score_s", send_scores, file_scores, scores_filed),
        scalable=True,
        # its calls' time is the step's time/score, exported as the reward role's busy time
        section=f"reward.{kind.name}",
        runs=lambda c: REWARD_KINDS[c.reward.kind].own_role == name,  # the kinds whose entry names it
    )
    return dataclasses.replace(standard, **described)


JUDGE = reward_role(
    REWARD_KINDS["judge"],
    summary="the LLM judge replicas: the rewards of reward.kind='judge'",
    # the judge (reward_service/judge.py) as the scorer's only backend, served by reward.judge.engine
    function="cluster.roles.actors:StreamingJudge",
    args=lambda c, p: (c.reward, c.tokenizer_path),
    work=Work(CallKind.JUDGE, "score_s", send_scores, file_scores, scores_filed),
    path_fields=("model_path",),
)
DESCRIBED = (LEARNER, ROLLOUT, REFERENCE, REWARD, JUDGE)


def _kinds_roles(described: tuple[Role, ...]) -> list[Role]:
    """The standard reward role of each kind whose entry names a role described nowhere else."""
    names = {r.name for r in described}
    return [reward_role(k) for k in REWARD_KINDS if k.own_role is not None and k.own_role not in names]


# Every role, in the plan's bundle order: those described above, the reward role of each kind with a role of
# its own described nowhere else (`reward_role`), then each role described in a module of its own, listed
# by its `"module:Role"` (that module imports `cluster.roles.role`, never this one).
ROLES: Registry[Role] = Registry(
    "role",
    "cluster.scale",
    [*DESCRIBED, *_kinds_roles(DESCRIBED)],
)


def _work(roles: Registry[Role]) -> dict[str, Work]:
    """The collector's calls by kind: one kind per role, none of them a kind of the driver's own calls."""
    work: dict[str, Work] = {}
    owner: dict[str, str] = {str(k): "the driver's own calls" for k in DRIVER_KINDS}
    for role in roles:
        if role.work is None:
            continue
        kind = str(role.work.kind)
        if kind in owner:
            raise ValueError(f"role {role.name!r}: call kind {kind!r} is already the kind of {owner[kind]}")
        owner[kind] = f"role {role.name!r}"
        work[role.work.kind] = role.work
    return work


BY_NAME: dict[str, Role] = {r.name: r for r in ROLES}
SCALABLE: tuple[Role, ...] = tuple(r for r in ROLES if r.scalable)  # the pools' roles, in this order
WORK: dict[str, Work] = _work(ROLES)


def call_kinds() -> frozenset[str]:
    """Every kind of call the driver tracks: its own and each role's work."""
    return frozenset(DRIVER_KINDS) | frozenset(WORK)


def running(cfg: RunConfig) -> tuple[Role, ...]:
    """The scalable roles this run starts actors for (a pool each), in the registry's order."""
    return tuple(r for r in SCALABLE if r.runs(cfg))


def placed_count(role: Role, cfg: RunConfig) -> int:
    """How many actors of `role` the config starts (0 for a role this run does not run)."""
    return role.count(cfg) if role.runs(cfg) else 0


def generate_kind() -> str:
    """The kind of the call that starts a chunk (it reads the prompts)."""
    return next(w.kind for w in WORK.values() if w.reads == "prompts")


def scoring_kinds(train: bool) -> tuple[str, ...]:
    """The calls a generated chunk makes next: every role that reads samples, or (held-out chunks,
    `train` False) those that also run on evaluation."""
    return tuple(w.kind for w in WORK.values() if w.reads == "samples" and (train or w.on_eval))


# ---------------------------------------------------------------------- groups outside the plan


@dataclass(frozen=True)
class Group:
    """Actors a run starts beside the plan (no bundle of its own, whatever the placement) whose count
    `cluster.scale` changes too: `name=K`. Resized by the object the launch keeps for it
    (`Roles.groups`), between steps, in either placement."""

    name: str
    count: Callable[[RunConfig], int]  # how many the config starts (0: none, not scalable in this run)


AGENT = Group("agent", count=lambda c: c.agent.actors)  # the agent runners (agent.function set)
GROUPS: tuple[Group, ...] = (AGENT,)


def scalable_names() -> tuple[str, ...]:
    """The names `cluster.scale` takes: the pools' roles, then the groups."""
    return tuple(r.name for r in SCALABLE) + tuple(g.name for g in GROUPS)


def group_names() -> tuple[str, ...]:
    return tuple(g.name for g in GROUPS)
