"""The logger interface every sink implements, and the records it is handed.

A sink opens one tracker run (a fresh one, or the one a checkpoint names when resuming), takes the
run's step rows, its summaries and its artifacts, and closes. Only the driver logs. A sink that is
not `essential` may fail: the run logger reports it once and goes on without it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

# The parts of a run's summary (`Sink.log_summary`).
STARTUP = "startup"  # seconds of each start-up phase, to the end of step 1 (startup.json)
EVAL_AFTER = "eval_after"  # the held-out evaluation of the final weights (also the last step's last row)
RUN = "run"  # the run's summary: steps, samples, wall seconds, final reward and KL


@dataclass(frozen=True)
class RunInfo:
    """Who the run is and what it was configured with, handed to every sink's `open`.
    `resume_step` is the checkpoint's step when resuming (rows after it are logged again), and
    `resume_ids` the tracker run ids that checkpoint kept, by sink name."""

    name: str
    run_id: str
    run_dir: Path
    config: dict[str, Any]
    settings: Any  # the run section (`cluster.config.sections.RunSection`): each sink's own settings
    resume_step: int | None = None
    resume_ids: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRow:
    """One row of the run's record: step `step`'s metrics. `held_out_only`: a held-out evaluation, no training
    step: of the initial weights (step 0), or of the final weights (the last step, after that step's training
    row; the same numbers as the `EVAL_AFTER` summary). `worker_lags` (async): versions each rollout worker
    trails."""

    step: int
    metrics: Mapping[str, float | None]
    worker_lags: Mapping[str, int] = field(default_factory=dict)
    held_out_only: bool = False

    def finite(self) -> dict[str, float]:
        """The metrics with a finite value (trackers that refuse NaN and inf get these)."""
        return {k: float(v) for k, v in self.metrics.items() if v is not None and math.isfinite(float(v))}


class Sink(ABC):
    """One tracker. `name` is its `run.loggers` entry (`cluster.config.sinks.SINKS`, with the package it needs);
    an `essential` sink's failure stops the run (the JSONL record)."""

    name: ClassVar[str]
    essential: ClassVar[bool] = False

    @abstractmethod
    def open(self, run: RunInfo) -> str | None:
        """Start (or, with `run.resume_ids[name]`, continue) the tracker's run; its id, kept in checkpoints."""

    @abstractmethod
    def log_step(self, row: StepRow) -> None:
        """Record one step's row."""

    @abstractmethod
    def log_summary(self, part: str, values: Mapping[str, float]) -> None:
        """Record one part of the run's summary (`STARTUP`, `EVAL_AFTER`, `RUN`)."""

    @abstractmethod
    def log_artifact(self, path: Path) -> None:
        """Keep a file of the run folder with the run (config.yaml, startup.json, curves.png)."""

    @abstractmethod
    def close(self) -> None:
        """End the tracker's run; nothing is logged after."""


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (`learner.kl.coef`); lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out
