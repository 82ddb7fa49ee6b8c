"""`run.loggers` names -> sink classes. A new tracker is one `Sink` subclass and one entry here."""

from __future__ import annotations

import importlib.util

from cluster.run.trackers.base import Sink
from cluster.run.trackers.jsonl_sink import JsonlSink
from cluster.run.trackers.mlflow_sink import MlflowSink
from cluster.run.trackers.prometheus_sink import PrometheusSink
from cluster.run.trackers.tensorboard_sink import TensorBoardSink
from cluster.run.trackers.wandb_sink import WandbSink

SINKS: dict[str, type[Sink]] = {
    cls.name: cls for cls in (JsonlSink, TensorBoardSink, WandbSink, MlflowSink, PrometheusSink)
}


def missing_packages(names: list[str]) -> list[str]:
    """One line per named sink whose package does not import here: what to install."""
    out = []
    for name in names:
        cls = SINKS[name]
        if cls.module and importlib.util.find_spec(cls.module) is None:
            out.append(f"{name!r} needs the {cls.module} package: pip install 'rayppo[{cls.extra}]'")
    return out
