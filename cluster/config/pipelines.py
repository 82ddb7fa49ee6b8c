"""The pipelines by name (`pipeline.mode`): the config's allowed values and the class a run builds
(`cluster.pipeline.run.Run`). A class is imported when a run starts, so the config loads without Ray.
A new pipeline is a class with the `cluster.pipeline.pipelines.Pipeline` protocol and one entry here."""

from __future__ import annotations

from kernel.registry import Part, Registry

PIPELINES: Registry[Part] = Registry(
    "pipeline",
    "pipeline.mode",
    [
        Part(
            name="sync",
            function="cluster.pipeline.sync_pipeline:SyncPipeline",
            summary="each step generates a whole batch, trains, pushes weights (lock-step)",
        ),
        Part(
            name="async",
            function="cluster.pipeline.stream_pipeline:StreamPipeline",
            summary="workers stream chunks while the learner trains; staleness bounded by max_staleness",
        ),
    ],
)
