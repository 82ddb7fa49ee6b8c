"""The streaming data plane's bookkeeping: the admission rule and the trajectory buffer of chunks
(`cluster.pipeline.collector.Chunk`, the record of a chunk in both pipelines).

Pure Python, no Ray: the async pipeline (`StreamPipeline`) feeds it events and asks it what to do next, and the tests
drive it directly.

Staleness (eta, in policy versions) is bounded twice:
- Admission (AReaL's capacity rule): with learner version v, at most (eta + v + 1) x P prompts may
  ever have been admitted (P = prompts per step; a prompt dropped as stale gives its slot back).
  Each worker loads the newest weights before each chunk, so a chunk admitted at version v is
  trained by one of the steps v+1 ... v+eta+1 when batches are taken in order.
- Consumption: a sample whose version is more than eta behind the learner's when its batch is
  taken is never trained: it is dropped, counted, and its prompt re-queued (ahead of new prompts),
  so every prompt of an epoch is still trained exactly once.

With `wait` (pipeline.stale_policy='wait') nothing is dropped: the learner at version v takes no batch
while a chunk admitted at version <= v - eta is still in flight (after this step it could only be
dropped), and it takes the ready prompts oldest first (by their oldest token's version). At most P
prompts admitted at <= v - eta are outstanding then (the admission rule), so they all fit in the
batch. The cost is learner idle time (`pipeline/learner_idle_frac`).

Dynamic sampling (`group_filter`, see `cluster.pipeline.dynamic_sampling`): a scored chunk's groups that the
filter refuses never enter the buffer; each gives its admission slot back (as a stale prompt does),
so a new prompt from the stream takes it and the stream cannot stall, and the bound above still holds
for every admitted prompt. A filtered prompt is used up: recorded in `filtered` (drained by the
trainer), never re-queued. `take` returns a batch short of P only when the groups scored since the
previous batch (ready + filtered) reach `max_rounds` x P.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from cluster.pipeline.dynamic_sampling import DynamicSamplingError, GroupFilter, split_chunk
from cluster.prompts.loader import Prompt, PromptStream
from cluster.records.chunks import Chunk, Parts, chunk_seed


@dataclass
class Taken:
    """One learner batch: (chunk, sample positions) in chunk order, plus what was dropped on the way."""

    parts: Parts
    items: list[tuple[Chunk, Prompt, list[int]]]  # the buffer entries taken (give_back returns them)
    stale_samples: int = 0
    stale_prompts: int = 0
    staleness: list[int] = field(default_factory=list)  # per trained sample
    filtered: int = 0  # dynamic sampling: groups filtered since the previous batch was taken
    shortfall: int = 0  # a short batch's missing groups, whose admission slots `take` used up

    @property
    def prompts(self) -> list[Prompt]:
        return [p for _c, p, _pos in self.items]


class StreamBuffer:
    def __init__(
        self,
        stream: PromptStream,
        prompts_per_step: int,
        chunk_size: int,
        max_staleness: int,
        run_seed: int,
        group_filter: GroupFilter | None = None,
        max_rounds: int = 1,
        wait: bool = False,
    ) -> None:
        self.stream = stream
        self.P = prompts_per_step
        self.chunk_size = chunk_size
        self.eta = max_staleness
        self.run_seed = run_seed
        self.requeued: collections.deque[Prompt] = collections.deque()
        self.ready: collections.deque[tuple[Chunk, Prompt, list[int]]] = collections.deque()
        self.inflight: dict[int, Chunk] = {}  # chunks not yet scored, by index
        self.wait = wait  # stale_policy 'wait': never drop, wait for the chunks about to go stale
        self.admitted = 0  # prompts admitted since version 0 (minus those given back)
        self.chunks = 0  # global chunk counter (seeds)
        self.pulled = 0  # prompts taken from the stream (batch-aligned chunking)
        self.group_filter = group_filter  # dynamic sampling (None: every group is kept)
        self.max_rounds = max_rounds
        self.filtered: list[Prompt] = []  # prompts filtered and not yet drained by the trainer
        self.filtered_since_take = 0

    # ------------------------------------------------------------------ admission

    def capacity(self, version: int) -> int:
        """Prompts that may still be admitted at learner version `version`."""
        return (self.eta + version + 1) * self.P - self.admitted

    def next_chunk(self, version: int) -> Chunk | None:
        """The next chunk to generate, or None when the admission rule says wait."""
        room = min(self.capacity(version), self.chunk_size)
        if room <= 0:
            return None
        if self.requeued:
            prompts = [self.requeued.popleft() for _ in range(min(room, len(self.requeued)))]
        else:
            # Chunks never straddle a step's prompts, so eta = 0 chunks exactly as sync mode does.
            take = min(room, self.P - self.pulled % self.P)
            prompts = self.stream.next_batch(take)
            self.pulled += take
        per_step = math.ceil(self.P / self.chunk_size)
        g = self.chunks
        # Chunk g gets the seed sync mode gives the chunk at the same position of the same step.
        chunk = Chunk(
            g, prompts, chunk_seed(self.run_seed, 1 + g // per_step, g % per_step), admitted=version
        )
        self.chunks += 1
        self.admitted += len(prompts)
        self.inflight[g] = chunk
        return chunk

    # ------------------------------------------------------------------ scored chunks

    def add_scored(self, chunk: Chunk) -> None:
        """A chunk whose samples, reference logprobs and scores are all in: its prompts become ready.

        Idempotent: only a chunk still in flight is added (a late duplicate result of a re-dispatched
        call, or a second scoring call finishing after the chunk was added, changes nothing), so a
        prompt enters the buffer at most once per admission."""
        if self.inflight.pop(chunk.index, None) is None:
            return
        kept, filtered = split_chunk(chunk, self.group_filter)
        for i, p in enumerate(chunk.prompts):
            if i in kept:
                self.ready.append((chunk, p, kept[i]))
            else:  # used up: its admission slot goes to a new prompt
                self.filtered.append(p)
                self.filtered_since_take += 1
                self.admitted -= 1

    def drain_filtered(self) -> list[Prompt]:
        """The prompts filtered since the last call (the trainer counts them)."""
        out, self.filtered = self.filtered, []
        return out

    def depth(self) -> int:
        """Prompts scored and waiting for the learner."""
        return len(self.ready)

    def take(self, version: int) -> Taken | None:
        """P prompts for the learner at `version`, or None if fewer fresh ones are ready.

        Samples older than eta versions are dropped and their prompts re-queued first.
        """
        fresh: collections.deque = collections.deque()
        stale_samples = stale_prompts = 0
        while self.ready:
            chunk, prompt, positions = self.ready.popleft()
            if version - chunk.version > self.eta:
                stale_samples += len(positions)
                stale_prompts += 1
                self.requeued.append(prompt)
                self.admitted -= 1
            else:
                fresh.append((chunk, prompt, positions))
        self.ready = fresh
        if self.wait:
            if any(c.admitted <= version - self.eta for c in self.inflight.values()):
                # a chunk in flight would be too old after this step: the learner waits to train it in this one
                return None if not stale_prompts else Taken([], [], stale_samples, stale_prompts)
            self.ready = collections.deque(sorted(self.ready, key=lambda it: (it[0].version, it[0].index)))
        size = self.P
        seen = len(self.ready) + self.filtered_since_take  # groups scored since the previous batch
        if len(self.ready) < self.P and self.group_filter is not None and seen >= self.max_rounds * self.P:
            if not self.ready:
                raise DynamicSamplingError(
                    f"dynamic sampling: {self.filtered_since_take} groups filtered since the last batch and "
                    f"none kept (data.dynamic_sampling.max_rounds={self.max_rounds}): every group's rewards "
                    "were equal. Raise data.dynamic_sampling.max_rounds, check the reward, or set "
                    "data.dynamic_sampling.filter='none'"
                )
            size = len(self.ready)  # a short batch: max_rounds batches' worth of groups were seen
        if len(self.ready) < size:
            return (
                None
                if not stale_prompts
                else Taken([], [], stale_samples=stale_samples, stale_prompts=stale_prompts)
            )
        items = [self.ready.popleft() for _ in range(size)]
        filtered, self.filtered_since_take = self.filtered_since_take, 0
        self.admitted += self.P - size  # a short batch's missing groups keep their slots (as at restore)
        items.sort(key=lambda it: (it[0].index, it[2][0] if it[2] else -1))  # chunk order, as sync mode
        parts: Parts = []
        for chunk, _prompt, positions in items:
            if parts and parts[-1][0] is chunk:
                parts[-1][1].extend(positions)
            else:
                parts.append((chunk, list(positions)))
        for _chunk, positions in parts:
            positions.sort()
        staleness = [version - c.facts[j].version for c, pos in parts for j in pos]
        return Taken(
            parts, items, stale_samples, stale_prompts, staleness, filtered, self.P - size
        )  # parts copied positions

    def give_back(self, taken: Taken, lost: set[int]) -> int:
        """A batch the learner could not train because the objects of the chunks `lost` (indices)
        are gone: their prompts, and those of the same chunks still buffered, are re-queued to be
        generated again (their admission slots given back); the rest of the batch returns to the
        front of the buffer. Returns the number of prompts re-queued.

        Everything `take` did to the buffer's counts is undone, since no batch was trained: a short
        batch's missing groups give back the slots `take` used up for them, and the groups filtered
        before it count again towards the next short batch (`max_rounds`). Without that, a short batch
        given back at max_staleness 0 left no slot to admit anything and no count that could reach
        `max_rounds` x P: the learner waited for ever."""
        self.admitted -= taken.shortfall
        self.filtered_since_take += taken.filtered
        keep: collections.deque = collections.deque()
        requeued = 0
        for entry in [*taken.items, *self.ready]:
            if entry[0].index in lost:
                self.requeued.append(entry[1])
                self.admitted -= 1
                requeued += 1
            else:
                keep.append(entry)
        self.ready = keep
        return requeued

    # ------------------------------------------------------------------ checkpoint

    def outstanding(self) -> list[int]:
        """Prompt indices admitted and not yet trained (re-queued, scored, in flight), in that order."""
        out = [p.index for p in self.requeued]
        out += [p.index for _c, p, _pos in self.ready]
        out += [p.index for c in sorted(self.inflight.values(), key=lambda c: c.index) for p in c.prompts]
        return out

    def restore(self, version: int, outstanding: list[Prompt], chunks: int, pulled: int) -> None:
        """Resume: the prompts that were outstanding are generated again, first (with the new weights:
        samples buffered at the checkpoint would be stale after a restart anyway)."""
        self.requeued = collections.deque(outstanding)
        self.ready.clear()
        self.inflight.clear()
        self.admitted = version * self.P
        self.filtered, self.filtered_since_take = [], 0
        self.chunks = chunks
        self.pulled = pulled
