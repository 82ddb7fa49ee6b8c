"""One rollout batch: generate in chunks across workers, score each chunk as soon as it lands.

Scoring (reference logprobs and reward) of finished chunks overlaps the generation of others.
Every call has a deadline. A worker, reference or scorer that dies or is stuck past its timeout
is replaced and its chunk handed out again with the same seed, so each prompt is trained on
exactly once per epoch. A sample whose reward failed is dropped and counted, never scored 0.

Samples never pass through the driver, in either pipeline: a worker returns (small facts per
sample, the samples) as two objects and the driver reads only the facts; the reference and the
scorer read the samples object themselves, the reference returns (count, logprobs) and the driver
waits on the count; the learner ranks assemble their trajectories from the references
(`StreamingLearnerRank.train_parts`). The driver holds facts and scores, never a token.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from typing import Any

import ray

from cluster.placement.pools import ActorPool, ActorStartError, Member
from cluster.prompts.loader import Prompt
from cluster.records.calls import Call, CallTracker
from cluster.records.chunks import LOST, Chunk, Faults, RolloutBatch, chunk_seed
from cluster.records.deadlines import Deadline
from cluster.records.ray_waits import DEAD_ACTOR_ERRORS, is_lost_object
from cluster.roles.registry import ROLES, WORK, CallKind, call_kinds, generate_kind, scoring_kinds


class RolloutError(RuntimeError):
    """A rollout could not be completed; the message names the actor and the cause."""


class RolloutTimeout(RolloutError, TimeoutError):
    """A chunk kept timing out after its replacements."""


# A prepare hook: for a freshly started member of a pool, the calls that must run before its first
# piece of work (e.g. loading the current weights), as (ref, timeout, check(value) -> None) triples.
Prepare = Callable[[str, Member], list[tuple[Any, float, Callable[[Any], None]]]]


class RolloutCollector:
    """Dispatch of generate/reference/reward calls with deadlines that start when the work starts,
    re-dispatch with the same seed, and replacement of dead or stuck actors in the background."""

    def __init__(
        self,
        by_role: dict[str, ActorPool],
        timeouts: Any,
        max_attempts: int = 3,
        prepare: Prepare | None = None,
        one_chunk_per_worker: bool = False,
    ) -> None:
        """`by_role`: the run's pools by role name; `timeouts`: the config's `timeouts` section (each
        role's `Work.timeout` names its call's deadline there; actor_start_s bounds a start)."""
        # the pool and the deadline of each kind of call the run's roles answer (`cluster.roles.registry.WORK`)
        self.pools = {r.work.kind: by_role[r.name] for r in ROLES if r.work is not None and r.name in by_role}
        self.timeouts = {kind: float(getattr(timeouts, WORK[kind].timeout)) for kind in self.pools}
        # Colocated roles take turns in one process, where smaller chunks overlap nothing and only
        # add per-call and per-token overhead: the batch is then split evenly over the workers.
        self.one_chunk_per_worker = one_chunk_per_worker
        self.max_attempts = max_attempts
        self.start_timeout = float(timeouts.actor_start_s)
        self.prepare = prepare

    # ------------------------------------------------------------------ submission

    def after_generate(self, train: bool) -> tuple[str, ...]:
        """The calls a generated chunk makes next in this run: every running role that reads samples,
        or (held-out chunks, `train` False) those that also score evaluation."""
        return tuple(kind for kind in scoring_kinds(train) if kind in self.pools)

    def complete(self, chunk: Chunk, train: bool = True) -> bool:
        """`chunk` holds every answer it needs: its samples' facts and each `after_generate` call's."""
        return WORK[generate_kind()].filed(chunk) and all(
            WORK[k].filed(chunk) for k in self.after_generate(train)
        )

    def pick(self, kind: str) -> Member:
        """The member of `kind`'s pool that gets the next piece of work (round-robin)."""
        pool = self.pools[kind]
        return pool.members[pool.next()]

    def submit(self, tracker: CallTracker, kind: str, chunk: Chunk, member: Member | None = None) -> Call:
        """Send `kind` work for `chunk` to `member` (`pick`'s when None) and track it.

        Tracked is the small value the driver reads: the facts (generate), the count (reference),
        the scores (reward). Kept with the call are the payload's references, which only actors read:
        the samples (generate) and the reference logprobs."""
        member = member or self.pick(kind)
        ref, kept = WORK[kind].send(member.handle, chunk)
        return tracker.add(member.name, ref, kind, self.timeouts[kind], chunk, kept=kept, round=chunk.round)

    def record(self, tracker: CallTracker, call: Call, stats: Faults) -> Chunk | None:
        """Settle a finished call and file its result on its chunk: the facts and the samples'
        reference (generate), the reference logprobs' reference, or the scores. Returns the chunk, or
        None when there is nothing to file (a start or prepare call, a failed call handed out again,
        a result of a round whose samples were lost)."""
        ok, value = self.settle(tracker, call, stats)
        if not ok or call.kind not in self.pools or not self.current(call):
            return None
        chunk = call.payload
        WORK[call.kind].file(chunk, value, call.kept)
        return chunk

    @staticmethod
    def current(call: Call) -> bool:
        """`call` belongs to its chunk's current round (not to samples since lost)."""
        return call.round == call.payload.round

    def resubmit(self, tracker: CallTracker, call: Call, member: Member | None) -> bool:
        """Hand `call`'s work out again (same chunk, same seed) to `member` or `pick`'s;
        False for work of a round whose samples were lost (that chunk is being generated again)."""
        if not self.current(call):
            return False
        self.submit(tracker, call.kind, call.payload, member)
        return True

    def regenerate(self, tracker: CallTracker, call: Call, stats: Faults) -> None:
        """A call's input samples (scoring) or its own result (generate) were lost with the node that
        held the only copy: generate the chunk again, same seed, and ignore whatever its old round
        still returns."""
        if not self.current(call):
            return  # another call of that round already started the new one
        self.lose(call.payload, stats)
        self.submit(tracker, CallKind.GENERATE, call.payload)

    def lose(self, chunk: Chunk, stats: Faults, what: str = "samples") -> None:
        """Count a loss of `chunk`'s objects (`what`) and forget its results, so it is generated again;
        a chunk lost max_attempts times is given up."""
        chunk.attempts[LOST] += 1
        if chunk.attempts[LOST] >= self.max_attempts:
            raise RolloutError(f"the {what} of chunk {chunk.index} were lost {chunk.attempts[LOST]} times")
        chunk.lost()
        stats.lost += 1
        stats.events.append(f"chunk {chunk.index}: {what} lost with their node; generating it again")

    # ------------------------------------------------------------------ faults

    def fail(self, tracker: CallTracker, call: Call, why: str, stats: Faults) -> None:
        """`call` died or is stuck: count an attempt on its chunk, replace its actor in the background
        and hand every call queued on that actor out again (the others count no attempt)."""
        chunk = call.payload
        if call.kind in self.pools:
            chunk.attempts[call.kind] += 1
            if chunk.attempts[call.kind] >= self.max_attempts:
                cls = RolloutTimeout if why.startswith("stuck") else RolloutError
                raise cls(
                    f"{call.kind} of chunk {chunk.index} failed {chunk.attempts[call.kind]} times; last: {call.actor} {why}"
                )
        pool = self.pool_of(call.actor)
        if pool is None:  # the actor was already replaced (another of its calls failed first)
            if call.kind in self.pools and self.resubmit(tracker, call, None):
                stats.redispatched += 1
            return
        index = pool.names.index(call.actor)
        # A stuck call is still at the head of its actor's queue, so `drop_actor` returns it too: each
        # call is handed out again once (by identity: calls compare by `is`).
        orphans = list(dict.fromkeys([call, *tracker.drop_actor(call.actor)]))
        new = self.replace_in_background(tracker, pool, index)
        stats.replacements += 1
        stats.events.append(f"{call.actor} {why}; replaced by {new.name}")
        for orphan in orphans:
            if orphan.kind in self.pools and self.resubmit(
                tracker, orphan, new if orphan.kind == CallKind.GENERATE else None
            ):
                stats.redispatched += 1

    def pool_of(self, actor: str) -> ActorPool | None:
        for pool in self.pools.values():
            if actor in pool.names:
                return pool
        return None

    def replace_in_background(self, tracker: CallTracker, pool: ActorPool, index: int) -> Member:
        """Start a replacement without waiting for it: its start and preparation are tracked calls
        queued ahead of any work, so results of other actors keep being collected meanwhile."""
        new = pool.begin_replace(index)
        self.track_start(tracker, next(k for k, p in self.pools.items() if p is pool), new)
        return new

    def track_start(self, tracker: CallTracker, kind: str, member: Member) -> None:
        """Track a just-launched member's start (`ping`, timeouts.actor_start_s) and its preparation,
        queued on it ahead of any work."""
        tracker.add(member.name, member.handle.ping.remote(), CallKind.START, self.start_timeout)
        self.track_prepare(tracker, member, self.prepare(kind, member) if self.prepare else [])

    @staticmethod
    def track_prepare(tracker: CallTracker, member: Member, calls: list) -> None:
        """Track `(ref, timeout, check)` calls queued on `member` ahead of its next work; `check`
        runs on each value when it arrives."""
        for ref, timeout, check in calls:
            tracker.add(member.name, ref, CallKind.PREPARE, timeout, check=check)

    def settle(self, tracker: CallTracker, call: Call, stats: Faults) -> tuple[bool, Any]:
        """Get a finished call's value. Returns (True, value), or (False, None) after a dead actor was
        replaced and its work re-dispatched. A start or prepare call that fails is an error."""
        try:
            value = ray.get(call.ref)
        except DEAD_ACTOR_ERRORS:
            pool = self.pool_of(call.actor)
            if call.kind in (CallKind.START, CallKind.PREPARE) and pool is not None:
                member = pool.members[pool.names.index(call.actor)]
                if member.restarts >= self.max_attempts:  # replacements keep dying: give up
                    raise RolloutError(
                        f"{call.actor} died while starting or loading weights ({member.restarts} restarts)"
                    ) from None
            self.fail(tracker, call, "died", stats)
            return False, None
        except ray.exceptions.RayError as err:
            if is_lost_object(err) and call.kind in self.pools:  # its samples or their facts are gone
                self.regenerate(tracker, call, stats)
                return False, None
            if not isinstance(err, ray.exceptions.RayTaskError):
                raise
            if call.kind == CallKind.START:
                raise ActorStartError(f"{call.actor} failed to start: {err.cause!r}") from err
            raise RolloutError(f"{call.actor} failed in {call.kind}: {err.cause!r}") from err
        if call.kind == CallKind.PREPARE:
            assert call.check is not None
            call.check(value)
        return True, value

    def expire(self, tracker: CallTracker, stats: Faults) -> None:
        for call in tracker.expired():
            if call.kind == CallKind.START:
                raise ActorStartError(
                    f"{call.actor} not ready after {call.timeout:.0f}s (timeouts.actor_start_s)"
                )
            self.fail(tracker, call, f"stuck for {call.timeout:.0f}s", stats)

    # ------------------------------------------------------------------ one batch

    def collect(
        self,
        prompts: list[Prompt],
        step: int,
        run_seed: int,
        chunk_size: int,
        sampling: Any = None,
        reference: bool = True,
    ) -> RolloutBatch:
        """Generate and score `prompts`. `sampling` overrides the workers' sampling; without `reference`
        no reference logprobs are computed and the batch cannot be trained on (evaluation)."""
        t0 = time.perf_counter()
        if self.one_chunk_per_worker:
            chunk_size = max(1, math.ceil(len(prompts) / len(self.pools[CallKind.GENERATE])))
        batch = RolloutBatch(
            chunks=[
                Chunk(ci, prompts[s : s + chunk_size], chunk_seed(run_seed, step, ci), sampling=sampling)
                for ci, s in enumerate(range(0, len(prompts), chunk_size))
            ]
        )
        batch.time_generate = self._gather(batch, batch.chunks, reference)
        batch.time_score = time.perf_counter() - t0 - batch.time_generate
        return batch

    def regather(self, batch: RolloutBatch, lost: set[int]) -> None:
        """The learner could not read the objects of the chunks `lost` (indices; their node died with
        the only copy) and trained nothing: generate and score those chunks again with the same seeds
        (on the same weights, so the same samples where the engine is deterministic)."""
        chunks = [c for c in batch.chunks if c.index in lost]
        for chunk in chunks:
            self.lose(chunk, batch, "learner inputs")
        self._gather(batch, chunks, reference=True)

    def _gather(self, batch: RolloutBatch, chunks: list[Chunk], reference: bool) -> float:
        """Generate `chunks`, scoring each as soon as it lands, until all are scored; faults are
        counted on `batch`. Returns the seconds until the last chunk was generated."""
        t0 = time.perf_counter()
        scoring = self.after_generate(train=reference)
        tracker = CallTracker(call_kinds())
        for c in chunks:
            self.submit(tracker, CallKind.GENERATE, c)
        t_gen = None
        # every tracked call has its own deadline (`expire`); this one runs only with none tracked
        idle = Deadline(
            f"the rollout of {len(chunks)} chunks", "timeouts.generate_s", self.timeouts[CallKind.GENERATE]
        )
        while len(tracker):
            done = tracker.wait(idle)
            if not done:
                self.expire(tracker, batch)
                continue
            for call in done:
                chunk = self.record(tracker, call, batch)
                if chunk is None or call.kind != CallKind.GENERATE:
                    continue
                for kind in scoring:
                    self.submit(tracker, kind, chunk)
                waiting = sum(1 for c in chunks if c.facts is not None and not self.complete(c, reference))
                batch.queue_depth = max(batch.queue_depth, waiting)
                if t_gen is None and all(c.facts is not None for c in chunks):
                    t_gen = time.perf_counter() - t0
        return t_gen or 0.0


class StreamCollector(RolloutCollector):
    """Submission for async mode (the sync collector's, object refs between actors): least-loaded
    members, drained members."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tracker = CallTracker(call_kinds())
        self.draining: set[str] = set()
        # whether a worker may sample now (False while it waits for a broadcast of the current weights)
        self.may_generate: Callable[[Any], bool] = lambda member: True
        self.held: collections.deque[Chunk] = collections.deque()  # generate work no worker may take yet

    def live(self, kind: str) -> list[Any]:
        members = [m for m in self.pools[kind].members if m.name not in self.draining]
        return [m for m in members if self.may_generate(m)] if kind == CallKind.GENERATE else members

    def pick(self, kind: str) -> Any:
        """The live member of `kind`'s pool with the fewest calls outstanding (None: no worker may
        generate now)."""
        return min(self.live(kind), key=lambda m: self.tracker.pending(m.name), default=None)

    def submit(self, tracker: CallTracker, kind: str, chunk: Chunk, member: Any = None) -> Call | None:
        """As the sync collector's; generate work for a worker that may not sample now goes to another
        that may, or is held until one can (`held`, handed out first by the dispatcher)."""
        if kind == CallKind.GENERATE and (member is None or not self.may_generate(member)):
            member = self.pick(kind)
            if member is None:
                self.held.append(chunk)
                return None
        return super().submit(tracker, kind, chunk, member)
