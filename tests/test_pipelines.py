"""The run and its pipelines (`cluster/pipeline/pipelines.py`): every registered pipeline answers the
interface's calls with its parameters, `pipeline.mode`'s allowed values are the registry's names, and a
run builds the publisher and the pipeline of its mode. The pipelines' behaviour end to end is the slow
suites' (`test_end_to_end`, `test_streaming`, `test_operations`: sync against async, resume)."""

from __future__ import annotations

import inspect
from typing import get_args

import pytest
from test_config import tree

from cluster.config.pipelines import PIPELINES
from cluster.config.schema import build_config
from cluster.config.sections import PipelineSection
from cluster.pipeline.pipelines import Pipeline
from cluster.pipeline.run import pipeline_of
from cluster.pipeline.stream_pipeline import StreamPipeline
from cluster.pipeline.sync_pipeline import SyncPipeline
from cluster.weights.async_publisher import AsyncPublisher
from cluster.weights.publisher import WeightPublisher

CALLS = ("__init__", "step", "scale", "state", "replace_lost_worker", "workers_to_current")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_modes_the_config_allows_are_the_registered_pipelines():
    assert set(get_args(PipelineSection.model_fields["mode"].annotation)) == set(PIPELINES.names())


@pytest.mark.parametrize("mode", sorted(PIPELINES.names()))
def test_every_pipeline_answers_the_interface_with_its_parameters(mode):
    cls = PIPELINES.function(mode)
    for call in CALLS:
        assert _params(getattr(cls, call)) == _params(getattr(Pipeline, call)), (mode, call)
    assert issubclass(cls.publisher, WeightPublisher)


def test_the_interface_names_every_call_a_run_makes_of_its_pipeline():
    """`Run` reaches its pipeline only through the interface: every `self.pipeline.<name>` in run.py is
    one of its calls."""
    import re

    from cluster.pipeline import run

    used = set(re.findall(r"self\.pipeline\.(\w+)", inspect.getsource(run)))
    assert used and used <= set(CALLS), used - set(CALLS)


@pytest.mark.parametrize(
    ("mode", "pipeline", "publisher"),
    [("sync", SyncPipeline, WeightPublisher), ("async", StreamPipeline, AsyncPublisher)],
)
def test_a_run_builds_the_publisher_and_pipeline_of_its_mode(mode, pipeline, publisher):
    cfg = build_config(tree(pipeline={"mode": mode}))
    pipeline_class, weights = pipeline_of(cfg)  # what `Run`'s constructor builds first
    assert pipeline_class is pipeline and type(weights) is publisher
