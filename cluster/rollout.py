"""One rollout batch: generate in chunks across workers, score each chunk as soon as it lands.

Scoring (reference logprobs and reward) of finished chunks overlaps the generation of others.
Every call has a deadline. A worker, reference or scorer that dies or is stuck past its timeout
is replaced and its chunk handed out again with the same seed, so each prompt is trained on
exactly once per epoch. A sample whose reward failed is dropped and counted, never scored 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from learner.batch import Trajectory
from rollout_workers.types import Sample

from .data import Prompt
from .pools import DEAD_ACTOR_ERRORS, ActorPool, wait_until


class RolloutError(RuntimeError):
    """A rollout could not be completed; the message names the actor and the cause."""


class RolloutTimeout(RolloutError, TimeoutError):
    """A chunk kept timing out after its replacements."""


@dataclass
class RolloutBatch:
    samples: list[Sample]
    trajectories: list[Trajectory]
    scores: np.ndarray  # of kept samples
    dropped: int = 0
    reward_errors: list[str] = field(default_factory=list)
    time_generate: float = 0.0
    time_score: float = 0.0
    queue_depth: int = 0  # most chunks generated and waiting for their scores at once
    replacements: int = 0
    redispatched: int = 0
    events: list[str] = field(default_factory=list)


@dataclass
class _Chunk:
    index: int
    prompts: list[Prompt]
    seed: int
    samples: list[Sample] | None = None
    ref_logprobs: list[np.ndarray] | None = None
    scores: Any = None
    attempts: int = 0


@dataclass
class _Call:
    kind: str  # "generate" | "reference" | "reward"
    chunk: _Chunk
    pool: ActorPool
    handle: Any
    name: str
    deadline: float


def chunk_seed(run_seed: int, step: int, chunk: int) -> int:
    """Sampling seed that depends only on (run, step, chunk), not on which worker runs it."""
    return int(np.random.SeedSequence([run_seed, step, chunk]).generate_state(1)[0])


class RolloutCollector:
    def __init__(
        self,
        workers: ActorPool,
        references: ActorPool,
        scorers: ActorPool,
        generate_timeout: float,
        score_timeout: float,
        max_attempts: int = 3,
    ) -> None:
        self.pools = {"generate": workers, "reference": references, "reward": scorers}
        self.timeouts = {"generate": generate_timeout, "reference": score_timeout, "reward": score_timeout}
        self.max_attempts = max_attempts

    # ------------------------------------------------------------------ submission

    def _submit(self, kind: str, chunk: _Chunk, index: int | None = None) -> tuple[Any, _Call]:
        pool = self.pools[kind]
        member = pool.members[pool.next() if index is None else index]
        h = member.handle
        if kind == "generate":
            ref = h.generate.remote(
                [p.index for p in chunk.prompts], [p.ids for p in chunk.prompts], chunk.seed
            )
        else:
            p_ids = [s.prompt_ids for s in chunk.samples]
            r_ids = [s.response_ids for s in chunk.samples]
            if kind == "reference":
                ref = h.logprobs.remote(p_ids, r_ids)
            else:
                by_index = {p.index: p.meta for p in chunk.prompts}
                ref = h.score.remote(p_ids, r_ids, [by_index[s.prompt_index] for s in chunk.samples])
        return ref, _Call(kind, chunk, pool, h, member.name, time.monotonic() + self.timeouts[kind])

    def _retry(self, call: _Call, why: str, batch: RolloutBatch) -> tuple[Any, _Call]:
        chunk = call.chunk
        chunk.attempts += 1
        if chunk.attempts >= self.max_attempts:
            cls = RolloutTimeout if why.startswith("stuck") else RolloutError
            raise cls(
                f"{call.kind} of chunk {chunk.index} failed {chunk.attempts} times; last: {call.name} {why}"
            )
        pool = call.pool
        try:
            index = pool.index_of(call.handle)
        except KeyError:  # already replaced because of another call on the same actor
            index = None
        if index is not None:
            new = pool.replace(index)
            batch.replacements += 1
            batch.events.append(f"{call.name} {why}; replaced by {new.name}")
        batch.redispatched += 1
        return self._submit(call.kind, chunk, index)

    # ------------------------------------------------------------------ one batch

    def collect(self, prompts: list[Prompt], step: int, run_seed: int, chunk_size: int) -> RolloutBatch:
        t0 = time.perf_counter()
        batch = RolloutBatch(samples=[], trajectories=[], scores=np.zeros(0))
        chunks = [
            _Chunk(ci, prompts[s : s + chunk_size], chunk_seed(run_seed, step, ci))
            for ci, s in enumerate(range(0, len(prompts), chunk_size))
        ]
        inflight: dict[Any, _Call] = dict(self._submit("generate", c) for c in chunks)
        generating = len(chunks)
        t_gen = None
        while inflight:
            ready, _ = wait_until(list(inflight), 1, min(c.deadline for c in inflight.values()))
            if not ready:
                for ref in [r for r, c in inflight.items() if c.deadline <= time.monotonic()]:
                    call = inflight.pop(ref)
                    timeout = self.timeouts[call.kind]
                    new_ref, new_call = self._retry(call, f"stuck for {timeout:.0f}s", batch)
                    inflight[new_ref] = new_call
                continue
            ref = ready[0]
            call = inflight.pop(ref)
            try:
                value = ray.get(ref)
            except DEAD_ACTOR_ERRORS:
                new_ref, new_call = self._retry(call, "died", batch)
                inflight[new_ref] = new_call
                continue
            except ray.exceptions.RayTaskError as err:
                raise RolloutError(f"{call.name} failed in {call.kind}: {err.cause!r}") from err
            chunk = call.chunk
            if call.kind == "generate":
                chunk.samples = value
                generating -= 1
                for kind in ("reference", "reward"):
                    new_ref, new_call = self._submit(kind, chunk)
                    inflight[new_ref] = new_call
                waiting = sum(
                    1
                    for c in chunks
                    if c.samples is not None and (c.scores is None or c.ref_logprobs is None)
                )
                batch.queue_depth = max(batch.queue_depth, waiting)
                if generating == 0:
                    t_gen = time.perf_counter() - t0
            elif call.kind == "reference":
                chunk.ref_logprobs = value
            else:
                chunk.scores = value
        batch.time_generate = t_gen or 0.0
        batch.time_score = time.perf_counter() - t0 - batch.time_generate
        self._assemble(chunks, batch)
        return batch

    @staticmethod
    def _assemble(chunks: list[_Chunk], batch: RolloutBatch) -> None:
        scores: list[float] = []
        for chunk in chunks:
            sb = chunk.scores
            for j, s in enumerate(chunk.samples):
                if not sb.ok[j]:
                    batch.dropped += 1
                    batch.reward_errors.append(sb.errors[j] or "unknown reward error")
                    continue
                batch.samples.append(s)
                scores.append(float(sb.scores[j]))
                batch.trajectories.append(
                    Trajectory(
                        prompt_ids=s.prompt_ids,
                        response_ids=s.response_ids,
                        behaviour_logprobs=s.logprobs,
                        ref_logprobs=chunk.ref_logprobs[j],
                        score=float(sb.scores[j]),
                        policy_version=s.policy_version,
                    )
                )
        batch.scores = np.asarray(scores, dtype=np.float64)
