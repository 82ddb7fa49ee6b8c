"""How the learner's weights reach separate rollout workers (`rollout.weight_sync`), each way registered
once with what the publishers need to know of it. (Colocated hosts take them in process instead,
`push.push_colocated`.)

A way's `function` is its pusher class, built with the run config (`from_config`) and answering
`push(ranks, workers, names, version, dtype, timeout, probe) -> (SyncResult, bundle | None)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cluster.config.schema import RunConfig
from kernel.registry import Part, Registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSync(Part):
    # one broadcast reaches every worker of the group at once: workers cannot take a version one by one,
    # so the async pipeline pauses dispatch for it and a late joiner waits for the next broadcast
    whole_group: bool = False
    # the pushed bundle stays in the object store, where a new or replacement worker loads it from; else
    # one is exported for it when it comes (`WeightPublisher.current_bundle`)
    leaves_bundle: bool = True


WEIGHT_SYNCS: Registry[WeightSync] = Registry(
    "weight sync",
    "rollout.weight_sync",
    [
        WeightSync(
            name="object_store",
            function="cluster.weights.push:ObjectStorePush",
            summary="every rank exports, each worker loads the bundle from Ray's object store",
        ),
        WeightSync(
            name="collective",
            function="cluster.weights.collective:CollectiveWeightSync",
            summary="learner rank 0 broadcasts bucket by bucket over a group of its own (NCCL on GPUs, gloo on CPUs)",
            whole_group=True,
            leaves_bundle=False,
        ),
    ],
)


def pusher(cfg: RunConfig) -> Any:
    """The pusher of the run's `rollout.weight_sync`."""
    return WEIGHT_SYNCS.function(cfg.rollout.weight_sync).from_config(cfg)
