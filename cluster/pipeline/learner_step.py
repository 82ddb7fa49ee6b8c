"""The learner's side of one async step (`LearnerStep`): wait for a batch, train on every rank, export
and publish the new weights, timing each phase. It holds no reference to its pipeline: it is handed
the two calls it makes of it (`start_train`, `give_back`) and the publisher it exports through
(`start_export`, `published`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.pipeline.stream_buffer import Taken
from cluster.records.calls import Call
from cluster.records.groups import LostInputs
from cluster.roles.registry import CallKind
from cluster.weights.push import Fingerprint, expected_fingerprint, stage_seconds

if TYPE_CHECKING:
    from cluster.weights.async_publisher import AsyncPublisher


class LearnerStep:
    """The learner's side of one async step: wait for a batch, train on every rank, export and
    publish the new weights (then `done`). Times each phase. Talks to its pipeline through
    `start_train` and `give_back`, and to its publisher through `start_export` and `published`."""

    def __init__(
        self,
        step: int,
        start_train: Callable[[Taken], list[Call]],
        give_back: Callable[[Taken, set[int]], None],
        weights: AsyncPublisher,
        rollout_dtype: str,
    ) -> None:
        self.step = step
        self._start_train, self._give_back = start_train, give_back
        self.weights, self.rollout_dtype = weights, rollout_dtype
        self.taken: Taken | None = None
        self.depth = 0
        self.train_calls: list[Call] = []
        self.export_calls: list[Call] = []
        self.bundle: Any = None
        self.fingerprint: Fingerprint | None = None
        self.metrics: dict[str, float] = {}
        self.stale_samples = self.stale_prompts = 0
        self.lost: set[int] = set()  # chunk indices whose objects a rank could not get
        self.aborted = False
        self.publishing = False  # collective: trained, waiting for the broadcast of its weights
        self.t0 = time.perf_counter()
        self.t1 = self.t2 = self.t0  # when training started, when publishing started
        self.t_wait = self.t_train = self.t_sync = 0.0
        self.done = False

    @property
    def waiting(self) -> bool:
        return self.taken is None

    @property
    def training(self) -> bool:
        """The ranks are busy with this step (training or exporting)."""
        return self.taken is not None and not self.publishing and not self.done

    def published(self) -> None:
        """The step's weights reached the workers (collective broadcast)."""
        self.t_sync = time.perf_counter() - self.t2
        self.done = True

    def start(self, taken: Taken, depth: int) -> None:
        self.taken, self.depth = taken, depth
        self.t_wait = time.perf_counter() - self.t0
        self.t1 = time.perf_counter()
        self.train_calls = self._start_train(taken)

    def finished(self, call: Call, value: Any) -> None:
        weights = self.weights
        if call.kind == CallKind.TRAIN:
            self.train_calls.remove(call)
            if isinstance(value, LostInputs):  # no rank trained: some input's object is gone
                self.lost.update(call.chunks[k].index for k in value.parts)
                self.aborted = True
            else:
                self.metrics = self.metrics or value  # every rank returns the same global metrics
            if self.train_calls:
                return
            if self.aborted:  # the step waits for a batch again
                self._give_back(self.taken, self.lost)
                self.taken, self.metrics, self.lost, self.aborted = None, {}, set(), False
                return
            self.t_train = time.perf_counter() - self.t1
            self.t2 = time.perf_counter()
            if weights.collective:
                self.publishing = True  # `AsyncPublisher.broadcast_due` broadcasts
            else:
                self.export_calls, self.bundle = weights.start_export(self.step)
            return
        self.export_calls.remove(call)
        if call.label == "fingerprint":
            self.fingerprint = expected_fingerprint(value, self.step, self.rollout_dtype)
            weights.probe_spent(self.fingerprint, stage_seconds(value, []))
        if not self.export_calls:  # published: workers load it before their next chunk
            self.t_sync = time.perf_counter() - self.t2
            weights.published(self.step, self.bundle, self.fingerprint)
            self.done = True
