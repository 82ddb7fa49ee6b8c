"""`run.loggers` names -> sink classes. A new tracker is one `Sink` subclass (`cluster/reporting/trackers/base.py`)
and one entry here.

Entries name their class as `module:Class` and import it only when a run opens its sinks, so the
config's validation (which reads the names) imports no tracker's code: that would pull the metric
libraries into every config check, and the reporting floor into the config's (tests/test_layout.py's floors).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from learner.registry import resolve


@dataclass(frozen=True)
class SinkEntry:
    cls: str  # `module:Class` of the sink
    package: str | None = None  # the package it needs, when not a dependency of the project
    extra: str | None = None  # the pip extra that installs that package

    def load(self) -> type:  # a `cluster.reporting.trackers.base.Sink` subclass
        return resolve(self.cls)


SINKS: dict[str, SinkEntry] = {
    "jsonl": SinkEntry("cluster.reporting.trackers.jsonl_sink:JsonlSink"),
    "tensorboard": SinkEntry(
        "cluster.reporting.trackers.tensorboard_sink:TensorBoardSink", "tensorboard", "tensorboard"
    ),
    "wandb": SinkEntry("cluster.reporting.trackers.wandb_sink:WandbSink", "wandb", "wandb"),
    "mlflow": SinkEntry("cluster.reporting.trackers.mlflow_sink:MlflowSink", "mlflow", "mlflow"),
    "prometheus": SinkEntry("cluster.reporting.trackers.prometheus_sink:PrometheusSink"),
}


def missing_packages(names: list[str]) -> list[str]:
    """One line per named sink whose package does not import here: what to install."""
    out = []
    for name in names:
        entry = SINKS[name]
        if entry.package and importlib.util.find_spec(entry.package) is None:
            out.append(f"{name!r} needs the {entry.package} package: pip install 'rayppo[{entry.extra}]'")
    return out
