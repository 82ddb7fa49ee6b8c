"""How new weights reach the workers in async mode (`AsyncPublisher`, the async pipeline's publisher).

- `rollout.weight_sync: object_store`: every rank exports after a step (`start_export`), the
  bundle stays an object reference, and a worker that is behind loads it ahead of its next chunk
  (`send_before_chunk`: a call queued before the chunk, never inside one).
- `rollout.weight_sync: collective`: a broadcast reaches its whole group at once, so workers cannot
  swap one by one. When a step's training ends, no new chunk is handed out (`paused`); the chunks in
  flight finish (their samples count as usual, one version older), then learner rank 0 broadcasts to
  every started worker and generation resumes (`broadcast_step`). A worker that is behind (new, or a
  replacement) gets no chunk until a broadcast includes it: the next publication, or at once while
  the learner waits for data. Its work in hand goes to an up-to-date worker or waits for one
  (`StreamCollector.held`).
- `pipeline.partial_rollout`: no worker waits for its chunk to end. At each publication every running
  worker that is behind gets the bundle at once, on its weight group (`worker_method(cut_in=True)`), and
  lets it in at its engine's next interruption point; on the collective path the broadcast goes out
  at once to every started worker, busy or not, and dispatch never pauses.
`worker_versions` records what each worker holds; the dispatcher and the metrics read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.config.schema import RunConfig
from cluster.records.calls import CallTracker
from cluster.records.deadlines import Deadline
from cluster.records.ray_waits import wait_until
from cluster.roles.registry import LEARNER, CallKind
from cluster.weights.publisher import WeightPublisher
from cluster.weights.push import bundle_facts, load_into


class StreamDispatch(Protocol):
    """What the publisher needs of the stream's collector (`cluster.pipeline.collector.StreamCollector`):
    its calls in flight, the workers leaving, the gate on who may generate, and how a worker's loads are
    queued before its next chunk."""

    tracker: CallTracker
    draining: set[str]  # the names of the workers on their way out
    may_generate: Callable[[Any], bool]

    def track_prepare(self, tracker: CallTracker, member: Any, calls: list) -> None: ...


@dataclass(frozen=True)
class ExportRefs:
    """An export in flight (`AsyncPublisher.start_export`): what the driver tracks, (actor, reference,
    label) per call (each rank's small flag; rank 0's fingerprint, labelled "fingerprint"), and rank 0's
    bundle, which stays an object reference the driver hands to the workers."""

    calls: list[tuple[str, Any, str]]
    bundle: Any


class AsyncPublisher(WeightPublisher):
    """The async pipeline's publisher: besides the published version, the version each worker holds."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.collective = self.sync.whole_group  # one broadcast reaches every worker at once
        self.worker_versions: dict[str, int] = {}
        self.paused = False  # collective: no new chunk until the broadcast is done
        self.collector: StreamDispatch | None = None

    def start_stream(self, collector: StreamDispatch) -> None:
        """The stream begins: every worker holds the published version; on the collective path a worker
        that is behind gets no chunk until a broadcast has included it."""
        self.collector = collector
        self.worker_versions = {n: self.version for n in self.roles.workers.names}
        if self.collective:
            collector.may_generate = lambda m: not self.behind(m)

    def prepare(self, kind: str, member: Any, cut_in: bool = False) -> list:
        if (
            kind == CallKind.GENERATE and self.collective
        ):  # it joins the next broadcast (`broadcast_step`, `broadcast_behind`)
            self.worker_versions[member.name] = 0
            return []
        if kind == CallKind.GENERATE:
            self.worker_versions[member.name] = self.version if self.bundle is not None else 0
        return super().prepare(kind, member, cut_in)

    def published(self, version: int, bundle: Any, fingerprint: Any) -> None:
        """v`version` is out. With pipeline.partial_rollout every started worker that is behind gets it
        now, on its weight group: one that is generating lets it in at its next interruption point."""
        super().published(version, bundle, fingerprint)
        c = self.collector
        if not (self.cut_in and c is not None and bundle is not None):
            return
        for m in self._started():
            self.send_before_chunk(m, cut_in=True)

    def _started(self) -> list[Any]:
        """Workers that are running (not starting, not draining)."""
        c = self.collector
        return [
            m
            for m in self.roles.workers.members
            if m.name not in c.draining and c.tracker.pending(m.name, CallKind.START) == 0
        ]

    def behind(self, member: Any) -> bool:
        return self.worker_versions.get(member.name, 0) < self.version

    def forget(self, names: set[str]) -> None:
        """Workers gone (drained, or replaced under a new name) hold nothing any more."""
        for name in names & set(self.worker_versions):
            del self.worker_versions[name]

    def lags(self, names: list[str]) -> dict[str, int]:
        """Versions each of `names` trails the published one."""
        return {n: self.version - self.worker_versions.get(n, 0) for n in names}

    def send_before_chunk(self, member: Any, cut_in: bool = False) -> None:
        """Queue the newest weights on a worker that is behind, ahead of its next chunk (the same
        load-and-check as a new worker's; `prepare` records the version it will hold). `cut_in`: on its
        weight group, let in while it generates (pipeline.partial_rollout)."""
        if self.bundle is not None and self.behind(member):
            c = self.collector
            c.track_prepare(c.tracker, member, self.prepare(CallKind.GENERATE, member, cut_in=cut_in))

    def broadcast_step(self, version: int) -> bool:
        """rollout.weight_sync='collective', a step's weights v`version` are due: broadcast them to every
        started worker once their chunks in flight are done (none is handed out meanwhile; with partial
        rollouts the broadcast cuts into generation at once). True once broadcast."""
        started = self._started()
        self.paused = not self.cut_in
        if self.paused and any(self.collector.tracker.pending(m.name) for m in started):
            return False  # their chunks in flight finish first
        self.broadcast(version, started)
        self.paused = False
        return True

    def broadcast_behind(self) -> None:
        """rollout.weight_sync='collective', the learner between steps: broadcast the current version to
        the started workers that are behind and hold no chunk (the others keep sampling)."""
        c = self.collector
        if behind := [
            m for m in self._started() if self.behind(m) and (self.cut_in or not c.tracker.pending(m.name))
        ]:
            self.broadcast(self.version, behind)

    def broadcast(self, version: int, members: list[Any]) -> None:
        """Broadcast v`version` to `members` and record what each holds (a lost one's replacement,
        under a new name, is behind)."""
        self.push(version, members)
        present = set(self.roles.workers.names)
        for m in members:
            if m.name in present:
                self.worker_versions[m.name] = version

    def workers_to_current(self) -> None:
        """After the last step: every live worker loads the newest weights (after the calls it has queued)."""
        if self.collective:
            behind = [m for m in self.roles.workers.members if self.behind(m)]
            # their queued calls done first; a dead one is lost in the broadcast (replaced, counted)
            limit = self.cfg.timeouts.actor_start_s
            wait = Deadline("the workers' calls before the last broadcast", "timeouts.actor_start_s", limit)
            pings = [m.handle.ping.remote() for m in behind]
            _, silent = wait_until(pings, len(pings), wait.at)
            if silent:
                raise wait.error(", ".join(m.name for m, p in zip(behind, pings, strict=True) if p in silent))
            if behind:
                self.broadcast(self.version, behind)
            return
        limit = self.cfg.timeouts.weight_sync_s + self.cfg.timeouts.generate_s
        for m in self.roles.workers.members:
            if self.bundle is not None and self.behind(m):
                load_into(m.handle, m.name, self.bundle, self.version, self.fingerprint, limit)
                self.checked([m.name], self.fingerprint)
                self.worker_versions[m.name] = self.version

    def start_export(self, version: int) -> ExportRefs:
        """Every rank exports v`version` (ZeRO-3 gathers); rank 0's result is the bundle, and its
        fingerprint (probe logprobs when `probe_wanted` for the current workers, checksum, digest) is
        what the workers must acknowledge."""
        describe = bundle_facts(self.cfg.rollout.dtype)
        probe = self.probe_wanted(version, self.roles.workers.names)
        calls, bundle = [], None
        for i, r in enumerate(self.roles.ranks):
            flag, exported = r.export_split.remote(describe, self.cfg.rollout.dtype, probe)
            bundle = exported if i == 0 else bundle
            calls.append((LEARNER.member_name(i), flag, LEARNER.member_name(i)))
        fingerprint = self.roles.ranks[0].export_fingerprint.remote()  # after the export, same actor
        calls.append((LEARNER.member_name(0), fingerprint, "fingerprint"))
        return ExportRefs(calls, bundle)
