"""What a role of the run is, for the rest of cluster/: the `Role` descriptor, the `Work` the rollout
collector hands it, what building one of its actors takes (`Place`, `Resources`), the kinds of the
calls the driver tracks (`CallKind`), and the scoring call every reward role answers (`send_scores`,
`file_scores`).

The roles themselves are entries of `cluster.roles.registry.ROLES`. A role described in a module of
its own imports this module (never the registry, which lists it by `"module:Role"`), so that module
and one line of the registry add it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cluster.config.schema import RunConfig
from cluster.records.chunks import Chunk, prompt_facts
from kernel.registry import Part, resolve

WEIGHTS_GROUP = "weights"  # a rollout worker's concurrency group for loads that cut into a generation


class CallKind(StrEnum):
    """What a call the driver tracks is (`Call.kind`; a chunk's `attempts` key). The work kinds are the
    roles' (`Work.kind`, one per role the collector drives); the rest are the driver's own
    (`DRIVER_KINDS`). Spelled here only (tests/test_layout.py), but for the kind of a role described in a
    module of its own, which that module names; a str, so metrics and checkpoints read the same text."""

    GENERATE = "generate"  # a rollout worker generates a chunk
    REFERENCE = "reference"  # a reference replica scores a chunk's samples' logprobs
    REWARD = "reward"  # a reward scorer scores a chunk's samples
    JUDGE = "judge"  # a judge replica scores them
    START = "start"  # an actor's first ping (a failure is a start error)
    PREPARE = "prepare"  # loads queued on a worker before its next chunk (weights)
    TRAIN = "train"  # a learner rank's step
    EXPORT = "export"  # a learner rank's weight export (async pipeline)


# the driver's own calls' kinds (the rest are the roles' work); a role's work takes none of them
DRIVER_KINDS = frozenset({CallKind.START, CallKind.PREPARE, CallKind.TRAIN, CallKind.EXPORT})


@dataclass(frozen=True)
class Place:
    """What building one actor of a role needs besides the run config."""

    slot: int  # the actor's slot (a learner rank's number, a worker's index)
    worker_config: Any = None  # the rollout workers' section as placed (`RolloutPlacement.config`)
    environment: Any = None  # the `RemoteEnvironment` of rollout.environment.placement='actors', or None
    pad_token_id: int | None = None
    agents: Any = None  # the `RemoteAgents` of agent.function, or None


@dataclass(frozen=True)
class Resources:
    """What each actor of a role holds (the separate placement's bundle)."""

    num_cpus: float
    num_gpus: float
    custom: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Work:
    """A role the rollout collector hands chunks to.

    `send(handle, chunk)` makes the call and returns (what the driver waits on and reads, the payload
    it keeps for other actors or None); `file(chunk, value, kept)` puts the answer on the chunk.
    `reads` is what the call needs: the chunk's prompts, or the samples generated from them (then it
    runs once the chunk is generated); `on_eval`: held-out chunks make this call too."""

    # the call kind (`Call.kind`, a chunk's `attempts` key): a `CallKind` member for the roles described
    # in the registry's module; a role described in a module of its own names its own (its role's name)
    kind: str
    timeout: str  # the field of the `timeouts` section that is the call's deadline
    send: Callable[[Any, Chunk], tuple[Any, Any]]
    file: Callable[[Chunk, Any, Any], None]
    filed: Callable[[Chunk], bool]  # whether the chunk holds this call's answer
    reads: str = "samples"  # "prompts" | "samples"
    on_eval: bool = True


@dataclass(frozen=True, kw_only=True)
class Role(Part):
    # name: the name scaling takes, and its config section unless `section` says otherwise
    # function: `module:Class` of its actor (imported where the actor runs)
    prefix: str  # its actors' names: <prefix>-<slot>
    count: Callable[[RunConfig], int]  # how many the config starts
    resources: Callable[[RunConfig], Resources]
    args: Callable[[RunConfig, Place], tuple]  # the actor class's constructor arguments
    host_threads: Callable[[RunConfig], int]  # its torch threads inside a colocated host
    work: Work | None = None  # None: the collector does not drive it (the learner)
    scalable: bool = False  # its count may change while the run trains (separate placement)
    two_returns: frozenset[str] = frozenset()  # its methods that return (small fact, payload)
    after_learner_setup: bool = False  # a colocated host builds it once the learner's world exists
    busy_metric: str | None = None  # the step's timing that is this role's busy time (telemetry)
    path_fields: tuple[str, ...] = ()  # fields of its section that name files or folders
    section: str | None = None  # its config section's dotted path, when it is not `name`
    remote_options: Callable[[Place], dict[str, Any]] = lambda place: {}  # `ray.remote(...)` options
    runs: Callable[[RunConfig], bool] = lambda c: True  # False: this run starts none of its actors

    def actor_class(self) -> type:
        return resolve(self.function)

    def member_name(self, slot: int) -> str:
        """The name of its actor in `slot` (`learner-rank-0`); a replacement adds `.r<k>` (`ActorPool`)."""
        return f"{self.prefix}-{slot}"

    @property
    def config_section(self) -> str:
        """Its config section's dotted path ("reward.judge")."""
        return self.section or self.name

    def path_attributes(self) -> tuple[tuple[str, ...], ...]:
        """Its path fields as attribute paths from the run config."""
        parents = tuple(self.config_section.split("."))
        return tuple((*parents, name) for name in self.path_fields)


# ---------------------------------------------------------------------- the scoring call


def send_scores(handle: Any, chunk: Chunk) -> tuple[Any, Any]:
    """A reward role's call on a chunk: its samples scored with their prompts' facts (`score_samples`)."""
    return handle.score_samples.remote(chunk.samples_ref, prompt_facts(chunk.prompts)), None


def file_scores(chunk: Chunk, scores: Any, _kept: Any) -> None:
    chunk.scores = scores


def scores_filed(chunk: Chunk) -> bool:
    return chunk.scores is not None
