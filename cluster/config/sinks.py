"""`run.loggers` names -> sink classes. A new tracker is one `Sink` subclass (`cluster/reporting/trackers/base.py`)
and one entry here.

Entries name their class as `module:Class` and import it only when a run opens its sinks, so the
config's validation (which reads the names) imports no tracker's code: that would pull the metric
libraries into every config check, and the reporting floor into the config's (tests/test_layout.py's floors).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from kernel.registry import Part, Registry, resolve


@dataclass(frozen=True, kw_only=True)
class SinkEntry(Part):
    """`function` is the sink's `module:Class`."""

    package: str | None = None  # the package it needs, when not a dependency of the project
    extra: str | None = None  # the pip extra that installs that package

    def load(self) -> type:  # a `cluster.reporting.trackers.base.Sink` subclass
        return resolve(self.function)


SINKS: Registry[SinkEntry] = Registry(
    "logger",
    "run.loggers",
    [
        SinkEntry(
            name="jsonl",
            function="cluster.reporting.trackers.jsonl_sink:JsonlSink",
            summary="metrics.jsonl and summary.json in the run folder; required",
        ),
        SinkEntry(
            name="tensorboard",
            function="cluster.reporting.trackers.tensorboard_sink:TensorBoardSink",
            summary="TensorBoard event files",
            package="tensorboard",
            extra="tensorboard",
        ),
        SinkEntry(
            name="wandb",
            function="cluster.reporting.trackers.wandb_sink:WandbSink",
            summary="Weights & Biases (run.wandb)",
            package="wandb",
            extra="wandb",
        ),
        SinkEntry(
            name="mlflow",
            function="cluster.reporting.trackers.mlflow_sink:MlflowSink",
            summary="MLflow (run.mlflow)",
            package="mlflow",
            extra="mlflow",
        ),
        SinkEntry(
            name="prometheus",
            function="cluster.reporting.trackers.prometheus_sink:PrometheusSink",
            summary="live Ray metrics for Prometheus and the Ray dashboard",
        ),
    ],
)


def missing_packages(names: list[str]) -> list[str]:
    """One line per named sink whose package does not import here: what to install."""
    out = []
    for name in names:
        entry = SINKS[name]
        if entry.package and importlib.util.find_spec(entry.package) is None:
            out.append(f"{name!r} needs the {entry.package} package: pip install 'rayppo[{entry.extra}]'")
    return out
