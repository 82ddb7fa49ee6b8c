"""How new weights reach the workers in async mode (`AsyncTrainer`'s weight half).

- `rollout.weight_sync: object_store`: every rank exports after a step (`_start_export`), the
  bundle stays an object reference, and a worker that is behind loads it ahead of its next chunk
  (`_send_weights`: a call queued before the chunk, never inside one).
- `rollout.weight_sync: collective`: a broadcast reaches its whole group at once, so workers cannot
  swap one by one. When a step's training ends, no new chunk is handed out; the chunks in flight
  finish (their samples count as usual, one version older), then learner rank 0 broadcasts to every
  started worker and generation resumes (`_broadcast_due`). A worker that is behind (new, or a
  replacement) gets no chunk until a broadcast includes it: the next publication, or at once while
  the learner waits for data. Its work in hand goes to an up-to-date worker or waits for one
  (`StreamCollector.held`).
`worker_versions` records what each worker holds; the dispatcher and the metrics read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from .calls import Call
from .rollout import StreamCollector
from .weight_sync import bundle_facts, load_into

if TYPE_CHECKING:
    from .streaming import _LearnerStep


class AsyncWeights:
    """Mixin of `AsyncTrainer` (a `Trainer`): the weight-publication hooks of both paths."""

    def _prepare(self, kind: str, member: Any) -> list:
        if kind == "generate" and self.collective:  # it joins the next broadcast (`_broadcast_due`)
            self.worker_versions[member.name] = 0
            return []
        if kind == "generate":
            self.worker_versions[member.name] = self.version if self._bundle is not None else 0
        return super()._prepare(kind, member)

    def _behind(self, member: Any) -> bool:
        return self.worker_versions.get(member.name, 0) < self.version

    def _replace_lost(self, member: Any) -> None:
        """A worker lost during a broadcast: replaced in the background; it joins the next one. (Lost in
        the push of a resume, before the stream's collector exists: replaced as in sync mode.)"""
        if not isinstance(self.collector, StreamCollector):
            return super()._replace_lost(member)
        c, pool = self.collector, self.roles.workers
        c.tracker.drop_actor(member.name)
        c.replace_in_background(c.tracker, pool, pool.names.index(member.name))
        self._faults.replacements += 1
        self._faults.events.append(f"{member.name} lost during a weight broadcast; replaced")

    def _send_weights(self, member: Any) -> None:
        """Queue the newest weights on a worker that is behind, ahead of its next chunk (the same
        load-and-check as a new worker's; `_prepare` records the version it will hold)."""
        if self._bundle is not None and self.worker_versions.get(member.name, 0) < self.version:
            c = self.collector
            c.track_prepare(c.tracker, member, self._prepare("generate", member))

    def _broadcast_due(self, learner: _LearnerStep) -> None:
        """rollout.weight_sync='collective': broadcast when a step's weights are due (`learner.publishing`:
        to every started worker, once their chunks in flight are done; none is handed out meanwhile), or
        when a started worker is behind and the learner is between steps (to those workers only: they
        hold no chunk, the others keep sampling). Never while the learner trains."""
        c = self.collector
        if learner.training:
            return
        started = [
            m
            for m in self.roles.workers.members
            if m.name not in c.draining and c.tracker.pending(m.name, "start") == 0
        ]
        if learner.publishing:
            self.publishing_paused = True
            if any(c.tracker.pending(m.name) for m in started):
                return  # their chunks in flight finish first
            self._broadcast(learner.step, started)
            self.publishing_paused = False
            learner.published()
        elif behind := [m for m in started if self._behind(m) and not c.tracker.pending(m.name)]:
            self._broadcast(self.version, behind)

    def _broadcast(self, version: int, members: list[Any]) -> None:
        """Broadcast v`version` to `members` and record what each holds (a lost one's replacement,
        under a new name, is behind)."""
        self.sync_weights(version, members)
        present = set(self.roles.workers.names)
        for m in members:
            if m.name in present:
                self.worker_versions[m.name] = version

    def workers_to_current(self) -> None:
        """After the last step: every live worker loads the newest weights (after the calls it has queued)."""
        if self.collective:
            behind = [m for m in self.roles.workers.members if self._behind(m)]
            ray.get([m.handle.ping.remote() for m in behind], timeout=self.cfg.timeouts.actor_start_s)
            if behind:
                self._broadcast(self.version, behind)
            return
        limit = self.cfg.timeouts.weight_sync_s + self.cfg.timeouts.generate_s
        for m in self.roles.workers.members:
            if self._bundle is not None and self.worker_versions.get(m.name, 0) < self.version:
                load_into(m.handle, m.name, self._bundle, self.version, self._checksum, limit)
                self.worker_versions[m.name] = self.version

    def _start_export(self) -> tuple[list[Call], Any]:
        """Every rank exports (ZeRO-3 gathers); rank 0's result is the bundle, and its fingerprint
        (probe logprobs, checksum, digest) is what the workers must acknowledge. The driver tracks each rank's
        small flag; the bundle stays an object reference it hands to the workers."""
        add, limit = self.collector.tracker.add, self.cfg.timeouts.weight_sync_s
        describe = bundle_facts(self.cfg.rollout.dtype)
        calls, bundle = [], None
        for i, r in enumerate(self.roles.ranks):
            flag, exported = r.export_split.remote(describe, self.cfg.rollout.dtype)
            bundle = exported if i == 0 else bundle
            calls.append(add(f"learner-rank-{i}", flag, "export", limit, name=f"learner-rank-{i}"))
        fingerprint = self.roles.ranks[0].export_fingerprint.remote()  # after the export, same actor
        calls.append(add("learner-rank-0", fingerprint, "export", limit, name="fingerprint"))
        return calls, bundle
