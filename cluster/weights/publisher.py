"""The trainer's weight publisher: which weights the rollout workers must hold, and getting them there.

`WeightPublisher` owns the published version, its bundle (an object reference, or None on the
collective path) and the fingerprint every worker must acknowledge for it. The sync pipeline calls
`push` after each step; a new or replacement worker loads the current weights before its first
sample (`prepare`, `bring_up_to_date`). The async pipeline's publisher (`cluster.weights.async_publisher`)
extends it with per-worker versions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.config.schema import RunConfig
from cluster.roles.registry import CallKind
from cluster.weights.probe_cadence import ProbeCadence
from cluster.weights.push import (
    Fingerprint,
    export_bundle,
    load_into,
    push_colocated,
    verify_ack,
    worker_method,
)
from cluster.weights.syncs import WEIGHT_SYNCS, pusher


class WeightPublisher:
    """Publishes the learner's weights to the rollout workers (object store, collective, or in-process
    for colocated hosts) and records what each push cost."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.cut_in = cfg.pipeline.partial_rollout  # loads may cut into a generation (async only)
        self.version = 0
        self.bundle: Any = None  # the current weights in the object store, when there
        self.fingerprint: Fingerprint | None = None  # what a worker must acknowledge for `version`
        self.replacements = 0  # workers lost (and replaced) in the last push
        self.stages: dict[str, float] = {}  # where the pushes since the last `take_stages` spent their time
        self.roles: Any = None
        self._on_lost: Callable[[Any], None] | None = None
        self.sync = WEIGHT_SYNCS[cfg.rollout.weight_sync]
        self._pusher: Any = None  # built at the first push (`syncs.pusher`)
        self.probed: set[str] = set()  # workers whose engine has passed a probe comparison
        self.cadence = ProbeCadence(cfg.rollout.probe_every)

    def probe_wanted(self, version: int, names: list[str]) -> bool:
        """Whether pushing v`version` to `names` scores the probe: on `rollout.probe_every`'s cadence, and
        whenever one of them has not passed a probe yet (its first push)."""
        return self.cadence.due(version) or not self.probed.issuperset(names)

    def probe_spent(self, fingerprint: Fingerprint | None, stages: dict[str, float]) -> None:
        """A push of `fingerprint` spent `stages`: when it was probed, the cadence counts the probe's cost."""
        if fingerprint is not None and fingerprint.probe is not None:
            self.cadence.spent(ProbeCadence.cost(stages))

    def checked(self, names: list[str], fingerprint: Fingerprint | None) -> None:
        """`names` acknowledged a version whose `fingerprint` they were verified against."""
        if fingerprint is not None and fingerprint.probe is not None:
            self.probed.update(names)

    def bind(self, roles: Any, on_lost: Callable[[Any], None]) -> None:
        """The run's actors, once started; `on_lost(member)` replaces a worker lost during a push."""
        self.roles, self._on_lost = roles, on_lost

    def push(self, version: int, members: list[Any] | None = None) -> float:
        """Push v`version` to `members` (every rollout worker when None); a worker lost on the way is
        handed to `on_lost`. Returns the push's seconds."""
        r, rc, limit = self.roles, self.cfg.rollout, self.cfg.timeouts.weight_sync_s
        members = r.workers.members if members is None else members
        handles, names = [m.handle for m in members], [m.name for m in members]
        probe = self.probe_wanted(version, names)
        if r.hosts:
            result, bundle = push_colocated(r.hosts, handles, names, version, rc.dtype, limit, probe)
        else:
            self._pusher = self._pusher or pusher(self.cfg)
            result, bundle = self._pusher.push(r.ranks, handles, names, version, rc.dtype, limit, probe)
        self.published(result.version, bundle, result.expected)
        self.checked([n for i, n in enumerate(names) if i not in result.lost], result.expected)
        self.probe_spent(result.expected, result.stages)
        for index in result.lost:
            self._on_lost(members[index])
        self.replacements = len(result.lost)
        for stage, seconds in result.stages.items():
            self.stages[stage] = self.stages.get(stage, 0.0) + seconds
        return result.seconds

    def published(self, version: int, bundle: Any, fingerprint: Fingerprint | None) -> None:
        """v`version` is the current weights: `bundle` (None: not in the object store) and what a worker
        that loads them must acknowledge."""
        self.version, self.bundle, self.fingerprint = version, bundle, fingerprint

    def take_stages(self) -> dict[str, float]:
        """The push stages' seconds since the previous call (for the step's `weights/*` metrics)."""
        stages, self.stages = self.stages, {}
        return stages

    def current_bundle(self) -> Any:
        """The current weights in the object store. The collective path leaves none there, so a new
        or replacement worker gets them from an export made for it (the learner is idle then), checked
        against that export's own fingerprint."""
        if self.bundle is None and self.version > 0 and not self.sync.leaves_bundle:
            self.bundle, self.fingerprint = export_bundle(
                self.roles.ranks, self.version, self.cfg.rollout.dtype, self.cfg.timeouts.weight_sync_s
            )
        return self.bundle

    def bring_up_to_date(self, handle: Any, name: str) -> None:
        """A new or replaced worker loads the current weights before its first sample."""
        if self.version > 0 and self.current_bundle() is not None:
            load_into(
                handle, name, self.bundle, self.version, self.fingerprint, self.cfg.timeouts.weight_sync_s
            )
            self.checked([name], self.fingerprint)

    def prepare(self, kind: str, member: Any, cut_in: bool = False) -> list:
        """Calls queued on a replacement actor before its first work: a rollout worker loads the
        current weights (checked against their fingerprint when it acknowledges). With `cut_in` the load
        goes to the worker's weight group, to be let into the generation it runs now."""
        if kind != CallKind.GENERATE or self.version == 0 or self.current_bundle() is None:
            return []
        version, expected = self.version, self.fingerprint
        probe = expected is not None and expected.probe is not None
        ref = worker_method(member.handle, "load_weights", cut_in).remote(self.bundle, version, probe)

        def check(ack: Any, name: str = member.name) -> None:
            verify_ack(name, ack, version, expected)
            self.checked([name], expected)

        return [(ref, self.cfg.timeouts.weight_sync_s, check)]
