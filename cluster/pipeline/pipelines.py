"""The interface between a run (`cluster.pipeline.run.Run`) and the pipeline that moves its data.

A run owns what every pipeline shares (roles, learner ranks, weights, prompts, evaluation, progress,
checkpoints, loggers) and hands it to its pipeline once, as a `RunParts` record, after set-up. The
pipeline keeps its own machinery (collector, buffer, in-flight calls) and answers five calls:

- `step(step, targets)`: scale the pools to `targets` (the control actor's counts), then run one
  learner step: collect, train, publish the new weights, and record the step in `parts.progress`
  (its number, samples, prompts trained and filtered). Returns the step's metrics row.
- `scale(targets)`: only the scaling (the events, `+name` / `-name`).
- `state()`: the pipeline's part of a checkpoint (merged into the run's state); a pipeline built on
  resume receives it back as `resume`.
- `replace_lost_worker(member)`: a rollout worker died during a weight push.
- `workers_to_current()`: every rollout worker holds the newest weights (before the final evaluation).

A pipeline never holds its run: what it needs of it is in `RunParts`. `publisher` names the weight
publisher class the run builds for it (before set-up: starting a worker brings it up to date).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from cluster.config.schema import RunConfig
from cluster.pipeline.collector import RolloutCollector
from cluster.pipeline.evaluation import Evaluator
from cluster.pipeline.learner_calls import LearnerRanks
from cluster.pipeline.progress import RunProgress
from cluster.placement.launch import Roles
from cluster.prompts.loader import Prompt, PromptStream
from cluster.reporting.reward_failures import RewardFailureLog
from cluster.weights.publisher import WeightPublisher

# True while the learner may not take a batch (rollouts go on up to the staleness bound): what a fault
# test injects (`Run(learner_gate=...)`, `cluster.train.main(learner_gate=...)`) to hold it on purpose
LearnerGate = Callable[[], bool]


@dataclass
class RunParts:
    """What a run shares with its pipeline; built at the end of `Run`'s set-up (its constructor)."""

    cfg: RunConfig
    roles: Roles
    learner: LearnerRanks
    weights: WeightPublisher
    stream: PromptStream
    prompts: list[Prompt]
    evaluator: Evaluator
    progress: RunProgress
    data_stats: Any
    group_filter: Any  # dynamic sampling's filter (`resolve_filter`); None when it is off
    failures: RewardFailureLog  # the run's reward failures, the first ones shown and kept
    learner_gate: LearnerGate | None = None  # async: held while it says True; None: never held

    def collector(self, cls: type[RolloutCollector]) -> RolloutCollector:
        """A collector of `cls` over the run's pools, time-outs and weight preparation."""
        return collector_for(cls, self.roles, self.cfg, self.weights)


def collector_for(
    cls: type[RolloutCollector], roles: Roles, cfg: RunConfig, weights: WeightPublisher
) -> RolloutCollector:
    return cls(roles.by_role, cfg.timeouts, prepare=weights.prepare, one_chunk_per_worker=bool(roles.hosts))


def replace_in_pool(roles: Roles, member: Any) -> None:
    """A worker lost during a push: its replacement loads the weights just pushed before it samples."""
    roles.workers.replace(roles.workers.names.index(member.name))


@dataclass
class StepResult:
    """One finished learner step, as its pipeline reports it to the run."""

    metrics: dict[str, float]
    worker_lags: dict[str, int] = field(default_factory=dict)  # async: versions each worker trails


class Pipeline(Protocol):
    publisher: ClassVar[type[WeightPublisher]]

    def __init__(self, parts: RunParts, resume: dict | None) -> None: ...

    def step(self, step: int, targets: dict[str, int]) -> StepResult: ...

    def scale(self, targets: dict[str, int]) -> list[str]: ...

    def state(self) -> dict: ...

    def replace_lost_worker(self, member: Any) -> None: ...

    def workers_to_current(self) -> None: ...
