r"""The learner's side of one async step (`LearnerStep`), a small state machine the async pipeline owns:

    WAITING --start(batch)--> TRAINING --every rank trained--> EXPORTING --bundle and fingerprint--> DONE
       ^                          |                        \--(collective)--> PUBLISHING --published()--> DONE
       \---- an input was lost ---/  (the batch is given back and the step waits again)

It holds no reference to its pipeline or to the collector: it is handed the calls it makes of the
pipeline (`start_train`, `track_export`, `give_back`), and the publisher is a transport it exports
through (`start_export`: the references to track; `published`: the new version is out). Each phase is timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from cluster.pipeline.stream_buffer import Taken
from cluster.records.calls import Call
from cluster.records.groups import LostInputs
from cluster.weights.push import Fingerprint, expected_fingerprint, stage_seconds

if TYPE_CHECKING:
    from cluster.weights.async_publisher import AsyncPublisher, ExportRefs


class Phase(StrEnum):
    WAITING = "waiting"  # for a batch from the buffer
    TRAINING = "training"  # every rank trains on its shard
    EXPORTING = "exporting"  # every rank exports; rank 0's bundle and fingerprint are awaited
    PUBLISHING = "publishing"  # collective: trained, waiting for the broadcast of its weights
    DONE = "done"


class LearnerStep:
    """The learner's side of one async step (see the module's picture). Talks to its pipeline through
    `start_train`, `track_export` and `give_back`, and to its publisher through `start_export`,
    `probe_spent` and `published`."""

    def __init__(
        self,
        step: int,
        start_train: Callable[[Taken], list[Call]],
        track_export: Callable[[ExportRefs], list[Call]],
        give_back: Callable[[Taken, set[int]], None],
        weights: AsyncPublisher,
        rollout_dtype: str,
    ) -> None:
        self.step = step
        self._start_train, self._track_export, self._give_back = start_train, track_export, give_back
        self.weights, self.rollout_dtype = weights, rollout_dtype
        self.phase = Phase.WAITING
        self.taken: Taken | None = None
        self.depth = 0
        self.train_calls: list[Call] = []
        self.export_calls: list[Call] = []
        self.bundle: Any = None
        self.fingerprint: Fingerprint | None = None
        self.metrics: dict[str, float] = {}
        self.stale_samples = self.stale_prompts = 0
        self.lost: set[int] = set()  # chunk indices whose objects a rank could not get
        self.t0 = time.perf_counter()
        self.t1 = self.t2 = self.t0  # when training started, when publishing started
        self.t_wait = self.t_train = self.t_sync = 0.0

    @property
    def waiting(self) -> bool:
        return self.phase is Phase.WAITING

    @property
    def training(self) -> bool:
        """The ranks are busy with this step (training or exporting)."""
        return self.phase in (Phase.TRAINING, Phase.EXPORTING)

    @property
    def publishing(self) -> bool:
        return self.phase is Phase.PUBLISHING

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def published(self) -> None:
        """The step's weights reached the workers (the collective broadcast)."""
        assert self.phase is Phase.PUBLISHING, self.phase
        self.t_sync = time.perf_counter() - self.t2
        self.phase = Phase.DONE

    def start(self, taken: Taken, depth: int) -> None:
        assert self.phase is Phase.WAITING, self.phase
        self.taken, self.depth = taken, depth
        self.t_wait = time.perf_counter() - self.t0
        self.t1 = time.perf_counter()
        self.train_calls = self._start_train(taken)
        self.phase = Phase.TRAINING

    def finished(self, call: Call, value: Any) -> None:
        """A tracked call of this step ended with `value`: a rank's training, or a part of the export."""
        if self.phase is Phase.TRAINING:
            self._trained(call, value)
        elif self.phase is Phase.EXPORTING:
            self._exported(call, value)
        else:
            raise AssertionError(f"{call.kind} call finished while the learner step is {self.phase}")

    def _trained(self, call: Call, value: Any) -> None:
        self.train_calls.remove(call)
        if isinstance(value, LostInputs):  # no rank trained: some input's object is gone
            self.lost.update(call.chunks[k].index for k in value.parts)
        else:
            self.metrics = self.metrics or value  # every rank returns the same global metrics
        if self.train_calls:
            return
        if self.lost:  # the step waits for a batch again
            self._give_back(self.taken, self.lost)
            self.taken, self.metrics, self.lost = None, {}, set()
            self.phase = Phase.WAITING
            return
        self.t_train = time.perf_counter() - self.t1
        self.t2 = time.perf_counter()
        if self.weights.collective:
            self.phase = Phase.PUBLISHING  # the pipeline has the publisher broadcast when it is due
        else:
            refs = self.weights.start_export(self.step)
            self.bundle, self.export_calls = refs.bundle, self._track_export(refs)
            self.phase = Phase.EXPORTING

    def _exported(self, call: Call, value: Any) -> None:
        self.export_calls.remove(call)
        if call.label == "fingerprint":
            self.fingerprint = expected_fingerprint(value, self.step, self.rollout_dtype)
            self.weights.probe_spent(self.fingerprint, stage_seconds(value, []))
        if not self.export_calls:  # published: workers load it before their next chunk
            self.t_sync = time.perf_counter() - self.t2
            self.weights.published(self.step, self.bundle, self.fingerprint)
            self.phase = Phase.DONE
