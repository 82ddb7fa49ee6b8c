"""Async mode: rollout workers stream chunks while the learner trains (`pipeline.mode: async`).

One event loop on the driver moves small facts; samples travel between actors as object refs.
- Dispatch (`StreamCollector`): each worker holds at most `pipeline.max_inflight_per_worker` generate
  calls and gets the next chunk when one finishes (least-loaded first). A worker behind the newest
  published weights loads them first (a call queued ahead of its next chunk, never inside one).
- Admission and consumption bounds on staleness: `StreamBuffer`.
- The learner starts a step as soon as the buffer holds one batch; its new weights are published
  when exported; workers pick them up before their next chunk; acknowledgements are checked as
  they arrive, not waited for.
- Faults: the sync collector's machinery (deadlines from when a call starts, background
  replacement, re-dispatch with the same seed).
- Weights: `cluster.weights.async_publisher.AsyncPublisher` (object store: each worker swaps between its
  chunks; collective: a broadcast to all workers once their chunks in flight are done).
"""

from __future__ import annotations

import collections
import time
from typing import Any, ClassVar

import numpy as np

from cluster.pipeline.collector import StreamCollector
from cluster.pipeline.dynamic_sampling import async_rounds
from cluster.pipeline.evaluation import EvalRound
from cluster.pipeline.failures import check_failures
from cluster.pipeline.learner_calls import LearnerStepError
from cluster.pipeline.learner_step import LearnerStep
from cluster.pipeline.pipelines import RunParts, StepResult
from cluster.pipeline.stream_buffer import StreamBuffer, Taken
from cluster.records.calls import Call
from cluster.records.chunks import Chunk, Faults
from cluster.records.deadlines import Deadline
from cluster.reporting.metrics import StepFaults, StepTimes, step_metrics, version_metrics
from cluster.roles.registry import CallKind, running
from cluster.weights.async_publisher import AsyncPublisher, ExportRefs
from kernel.metric_names import merge_metrics

LEARNER_KINDS = (CallKind.TRAIN, CallKind.EXPORT)


class StreamPipeline:
    """The async pipeline (`pipeline.mode: async`): `StreamCollector` (dispatch), `StreamBuffer`
    (admission, staleness), `AsyncPublisher` (per-worker versions) and `LearnerStep` (one step's
    learner side). See `cluster.pipeline.pipelines` for what a run asks of it."""

    publisher: ClassVar[type[AsyncPublisher]] = AsyncPublisher

    def __init__(self, parts: RunParts, resume: dict | None) -> None:
        self.parts = parts
        cfg = self.cfg = parts.cfg
        self.roles, self.weights, self.progress = parts.roles, parts.weights, parts.progress
        self.collector = parts.collector(StreamCollector)
        self.weights.start_stream(self.collector)
        self.buffer = StreamBuffer(
            parts.stream,
            cfg.data.prompts_per_step,
            cfg.rollout.chunk_size,
            cfg.pipeline.max_staleness,
            cfg.run.seed,
            group_filter=parts.group_filter,
            max_rounds=cfg.data.dynamic_sampling.max_rounds,
            wait=cfg.pipeline.stale_policy == "wait",
        )
        if resume is not None:
            by_index = {p.index: p for p in parts.prompts}
            outstanding = [by_index[i] for i in resume.get("outstanding", [])]
            self.buffer.restore(
                self.weights.version, outstanding, int(resume.get("chunks", 0)), int(resume.get("pulled", 0))
            )
        self.busy = {CallKind.GENERATE: 0.0, "score": 0.0}
        self.faults = Faults()  # the step's (replacements, re-dispatches, losses)
        self.t_last = time.perf_counter()
        self.eval_queue: collections.deque[Chunk] = collections.deque()  # dispatched first
        self.eval_round: EvalRound | None = None
        self.eval_ready: dict[str, float] | None = None  # a finished round's metrics, for the next row

    @property
    def version(self) -> int:
        return self.weights.version

    def state(self) -> dict:
        return {
            "outstanding": self.buffer.outstanding(),
            "chunks": self.buffer.chunks,
            "pulled": self.buffer.pulled,
        }

    def replace_lost_worker(self, member: Any) -> None:
        """A worker lost during a broadcast: replaced in the background; it joins the next one."""
        c, pool = self.collector, self.roles.workers
        c.tracker.drop_actor(member.name)
        c.replace_in_background(c.tracker, pool, pool.names.index(member.name))
        self.faults.replacements += 1
        self.faults.events.append(f"{member.name} lost during a weight broadcast; replaced")

    def workers_to_current(self) -> None:
        self.weights.workers_to_current()

    def scale(self, targets: dict[str, int]) -> list[str]:
        """Grow in the background (new workers load the current weights, then pull); shrink by
        draining: a removed member takes no new work and leaves when its calls are done."""
        events = []
        for role in running(self.cfg):
            pool, kind = self.roles.by_role[role.name], role.work.kind
            live = [m for m in pool.members if m.name not in self.collector.draining]
            want = int(targets[role.name])
            if want < 1:
                raise ValueError(f"{pool.prefix}: at least one actor is needed (asked for {want})")
            for m in pool.launch(max(0, want - len(live))):
                pool.members.append(m)
                self.collector.track_start(self.collector.tracker, kind, m)
                events.append(f"+{m.name}")
            for m in live[want:]:
                self.collector.draining.add(m.name)
                events.append(f"-{m.name}")
        self._reap_drained()
        return events + self.roles.scale_groups(targets)

    def _reap_drained(self) -> None:
        """Remove drained members whose calls are all done (and forget replaced workers' versions)."""
        c = self.collector
        gone = set()
        for name in list(c.draining):
            if c.tracker.pending(name) == 0:
                pool = c.pool_of(name)
                if pool is not None:
                    pool.remove(name)
                gone.add(name)
                c.draining.discard(name)
        self.weights.forget(gone | (set(self.weights.worker_versions) - set(self.roles.workers.names)))

    # ------------------------------------------------------------------ the stream

    def _dispatch(self) -> None:
        c, limit = self.collector, self.cfg.pipeline.max_inflight_per_worker
        while not self.weights.paused:
            idle = [
                m for m in c.live(CallKind.GENERATE) if c.tracker.pending(m.name, CallKind.GENERATE) < limit
            ]
            if not idle:
                return
            member = min(idle, key=lambda m: c.tracker.pending(m.name))
            if c.held:
                chunk = c.held.popleft()
            elif self.eval_queue:
                chunk = self.eval_queue.popleft()
            else:
                chunk = self.buffer.next_chunk(self.version)
            if chunk is None:
                return
            self.weights.send_before_chunk(member)
            c.submit(c.tracker, CallKind.GENERATE, chunk, member)

    def _on_done(self, call: Call) -> Any:
        """Handle one finished call; returns the learner's value for learner calls."""
        c = self.collector
        if call.kind in LEARNER_KINDS:
            return self._learner_value(call)
        now = time.monotonic()
        if call.started is not None and call.kind in c.pools:
            self.busy[CallKind.GENERATE if call.kind == CallKind.GENERATE else "score"] += now - call.started
        chunk = c.record(c.tracker, call, self.faults)
        if chunk is None:
            return None
        if call.kind == CallKind.GENERATE:
            for kind in c.after_generate(train=not chunk.eval):
                c.submit(c.tracker, kind, chunk)
        if chunk.eval:
            if chunk.scores is not None:
                self._eval_chunk_scored(chunk)
        elif c.complete(chunk):
            self.buffer.add_scored(chunk)
        return None

    # ------------------------------------------------------------------ held-out evaluation

    def _queue_eval(self, step: int) -> None:
        """Hand the held-out prompts out as eval chunks, dispatched ahead of training chunks to workers
        that load the newest weights first (as before any chunk). One round at a time: a round due while
        the previous one is still out is skipped."""
        if self.eval_round is None:
            self.eval_round = EvalRound(
                step, self.parts.evaluator.prompts, self.cfg, self.parts.evaluator.failures
            )
            self.eval_queue.extend(self.eval_round.chunks)

    def _eval_chunk_scored(self, chunk: Chunk) -> None:
        if self.eval_round is not None and (m := self.eval_round.scored(chunk)) is not None:
            self.eval_ready, self.eval_round = m, None

    def _learner_value(self, call: Call) -> Any:
        return self.parts.learner.value(call.ref, call.label, self.progress.step + 1)

    def start_train(self, taken: Taken) -> list[Call]:
        """Every rank trains on its shard of `taken` (as in sync mode), tracked like any call."""
        add, limit = self.collector.tracker.add, self.cfg.timeouts.train_s
        return [
            add(name, ref, CallKind.TRAIN, limit, label=name, chunks=chunks)
            for name, ref, chunks in self.parts.learner.train_calls(taken.parts)
        ]

    def track_export(self, refs: ExportRefs) -> list[Call]:
        """A learner export's calls (`AsyncPublisher.start_export`), tracked like any call."""
        add, limit = self.collector.tracker.add, self.cfg.timeouts.weight_sync_s
        return [add(name, ref, CallKind.EXPORT, limit, label=label) for name, ref, label in refs.calls]

    def _check_learner_deadlines(self) -> None:
        for call in self.collector.tracker.expired():
            if call.kind in LEARNER_KINDS:
                what = "learner step" if call.kind == CallKind.TRAIN else "weight export"
                limit = "timeouts.train_s" if call.kind == CallKind.TRAIN else "timeouts.weight_sync_s"
                raise LearnerStepError(f"{what} not done within {call.timeout:.0f}s ({limit})")

    # ------------------------------------------------------------------ one learner step

    def step(self, step: int, targets: dict[str, int]) -> StepResult:
        c, progress = self.collector, self.progress
        self.faults = Faults()
        scaling = self.scale(targets)
        busy0 = dict(self.busy)
        learner = LearnerStep(
            step, self.start_train, self.track_export, self.give_back, self.weights, self.cfg.rollout.dtype
        )
        # every tracked call has its own deadline; with none tracked nothing can move: `idle` runs
        idle = Deadline(
            f"step {step} of the async pipeline", "timeouts.generate_s", self.cfg.timeouts.generate_s
        )
        while not learner.done:
            if self.weights.collective and learner.publishing:
                if self.weights.broadcast_step(learner.step):
                    learner.published()
                    break
            elif self.weights.collective and learner.waiting:
                self.weights.broadcast_behind()
            self._dispatch()
            gate = self.parts.learner_gate
            held = learner.waiting and gate is not None and gate()
            if held:  # an injected gate (a fault test's) holds the learner on purpose
                idle.renew()
            if learner.waiting and not held:
                got = self.buffer.take(self.version)
                if got is not None:
                    learner.stale_samples += got.stale_samples
                    learner.stale_prompts += got.stale_prompts
                    if got.parts:
                        self._check_rewards(step, got)
                        learner.start(got, self.buffer.depth() + self.cfg.data.prompts_per_step)
                        continue
            for call in c.tracker.wait(idle, lambda: self._stalled(learner)):
                value = self._on_done(call)
                if call.kind in LEARNER_KINDS:
                    learner.finished(call, value)
            if not learner.done:
                self._check_learner_deadlines()
                c.expire(c.tracker, self.faults)
                self._reap_drained()
        progress.step = step
        taken = learner.taken
        metrics = self._metrics(learner, busy0)
        progress.samples_seen += int(metrics["rollout/samples"])
        progress.record_batch(taken.parts)
        if self.parts.group_filter is not None:
            metrics = merge_metrics(metrics, self._dynamic_metrics(taken))
        metrics = merge_metrics(metrics, {"scale/events": float(len(scaling))})
        if self.eval_ready is not None:  # a held-out round that finished during this step
            metrics = merge_metrics(metrics, self.eval_ready)
            self.eval_ready = None
        live = [n for n in self.roles.workers.names if n not in self.collector.draining]
        result = StepResult(metrics, worker_lags=self.weights.lags(live))
        if self.parts.evaluator.due(step):
            self._queue_eval(step)
        return result

    def _stalled(self, learner: LearnerStep) -> str:
        """What a step with no call in flight is waiting for (the idle deadline's error names it)."""
        b, v = self.buffer, self.version
        if not learner.waiting:
            return f"no call in flight while the learner {'publishes' if learner.publishing else 'trains'}"
        return (
            f"no call in flight and no batch for the learner: {b.depth()} of {b.P} prompts ready, "
            f"{b.filtered_since_take} groups filtered since the last batch, {max(0, b.capacity(v))} prompts "
            f"admissible at v{v}, {len(b.requeued)} re-queued, {len(self.collector.held)} chunks held for a worker"
        )

    def _dynamic_metrics(self, taken: Taken) -> dict[str, float]:
        """Dynamic sampling: the prompts filtered during this step (each gave its admission slot to a new
        prompt from the stream: the step's extra prompts) are recorded as used up."""
        filtered = self.buffer.drain_filtered()
        self.progress.record_filtered([p.index for p in filtered])
        P = self.cfg.data.prompts_per_step
        return {
            "dynamic/filtered_groups": float(len(filtered)),
            "dynamic/extra_prompts": float(len(filtered)),
            "dynamic/rounds": float(async_rounds(len(taken.items), taken.filtered, P)),
            "dynamic/shortfall_groups": float(P - len(taken.items)),
            "dynamic/filtered_total": float(self.progress.filtered_total),
        }

    def _check_rewards(self, step: int, taken: Taken) -> None:
        total = sum(len(pos) for _c, pos in taken.parts)
        check_failures(self.cfg, step, taken.parts, total, self.parts.failures)

    def give_back(self, taken: Taken, lost: set[int]) -> None:
        """A batch no rank could train (inputs lost with their node): the lost chunks' prompts are
        generated again, the rest of the batch returns to the buffer."""
        self.buffer.give_back(taken, lost)
        self.faults.lost += len(lost)
        self.faults.events.append(f"learner inputs of chunks {sorted(lost)} lost; generating them again")

    def _metrics(self, step: LearnerStep, busy0: dict[str, float]) -> dict[str, float]:
        """The step's row (`step_metrics`, as sync mode builds it) with the async pipeline's own: the
        buffer, the staleness histogram, how new weights cut into responses, idle fractions, lags."""
        taken, depth = step.taken, step.depth
        now = time.perf_counter()
        wall, self.t_last = now - self.t_last, now
        staleness = np.array(taken.staleness)
        n_workers = max(len(self.roles.workers), 1)
        gen_busy = self.busy[CallKind.GENERATE] - busy0[CallKind.GENERATE]
        eta = self.cfg.pipeline.max_staleness
        live = [n for n in self.roles.workers.names if n not in self.collector.draining]
        lags = list(self.weights.lags(live).values())
        own = {
            "staleness/max": float(staleness.max()),
            **{f"staleness/hist_{k}": float((staleness == k).sum()) for k in range(eta + 1)},
            **version_metrics([c.facts[j] for c, pos in taken.parts for j in pos], step.step - 1),
            "rollout/queue_depth": float(depth),  # the buffer when the step began
            "pipeline/generator_idle_frac": float(max(0.0, 1.0 - gen_busy / (n_workers * wall))),
            "pipeline/learner_idle_frac": float(step.t_wait / wall),
            "weights/version_lag_mean": float(np.mean(lags)) if lags else 0.0,
            "weights/version_lag_max": float(max(lags)) if lags else 0.0,
            "time/wait_data": step.t_wait,
            "staleness/dropped_samples": float(step.stale_samples),
            "staleness/requeued_prompts": float(step.stale_prompts),
        }
        return step_metrics(
            taken.parts,
            step.metrics,
            StepTimes(
                gen_busy / n_workers, self.busy["score"] - busy0["score"], step.t_train, step.t_sync, wall
            ),
            StepFaults(self.faults.replacements, self.faults.redispatched, self.faults.lost),
            list(taken.staleness),
            data_stats=self.parts.data_stats,
            reward=self.cfg.reward,
            version=self.version,
            workers=len(self.roles.workers) - len(self.collector.draining),
            own=own,
        )
