"""The records of generated chunks, the same in both pipelines: pure bookkeeping, no Ray.

A `Chunk` is the prompts of one generate call and what became of them. The driver holds only small
facts per sample (prompt index, policy version, response length, finish reason) and the scores;
the samples and their reference logprobs stay object references that only actors read. Metrics,
reward-failure checks and the learner's shards are all computed from the facts (`Parts`: a batch
as (chunk, sample positions) in chunk order).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from cluster.prompts.loader import Prompt
from rollout_workers.environment import FAILED


class EpisodeFacts(NamedTuple):
    """What the driver learns of a multi-turn episode (rollout.environment)."""

    turns: int
    status: str  # 'done', 'max_turns', 'max_tokens', 'env_error' or 'env_timeout'
    model_tokens: int  # response tokens the policy sampled
    env_tokens: int  # observation tokens
    env_s: float  # seconds in the environment's calls
    info: dict  # the environment's counters (e.g. tool_calls), summed over the episode
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.status in FAILED


class SampleFacts(NamedTuple):
    """What the driver learns of one sample (a rollout worker returns these beside the samples object,
    which the driver never fetches)."""

    prompt_index: int
    version: int  # the policy version that sampled it: its oldest token's (pipeline.partial_rollout)
    length: int  # response tokens
    finish_reason: str  # 'stop' or 'length'
    episode: EpisodeFacts | None = None  # multi-turn rollouts only
    # pipeline.partial_rollout: (version, response tokens it sampled) when the response spans versions;
    # empty when every token was sampled by `version`
    spans: tuple[tuple[int, int], ...] = ()


class PromptFacts(NamedTuple):
    """What a reward scorer is sent of a prompt (its ids travel with the samples): the rendered text, the
    chat messages (None for plain text) and the row's other columns."""

    text: str
    messages: list[dict] | None
    meta: dict


def prompt_facts(prompts: list[Prompt]) -> dict[int, PromptFacts]:
    """The facts of `prompts` by prompt index, as `StreamingScorer.score_samples` takes them."""
    return {p.index: PromptFacts(p.text, p.messages, p.meta) for p in prompts}


def sample_facts(sample: Any) -> SampleFacts:
    """The facts of one `rollout_workers.types.Sample` (built where the sample is, on the worker)."""
    e = sample.episode
    episode = None
    if e is not None:
        model = int(e.loss_mask.sum())
        episode = EpisodeFacts(
            e.turns, e.status, model, len(e.loss_mask) - model, float(e.env_s), dict(e.info), e.error
        )
    spans = ()
    if sample.token_versions is not None:
        versions, counts = np.unique(sample.token_versions, return_counts=True)
        spans = tuple((int(v), int(c)) for v, c in zip(versions, counts, strict=True))
    return SampleFacts(
        sample.prompt_index,
        sample.policy_version,
        len(sample.response_ids),
        sample.finish_reason,
        episode,
        spans,
    )


LOST = "lost"  # a chunk's `attempts` key counting the times its objects were lost with a node


@dataclass(eq=False)
class Chunk:
    """Prompts handed to one worker in one generate call, and what became of them: the one record of
    a chunk in both pipelines (the sync collector's batch, the async buffer's entries). `index`
    numbers the chunks of a batch (sync) or of the whole stream (async)."""

    index: int
    prompts: list[Prompt]
    seed: int
    # failures per call kind of its work (`Work.kind`), and its losses (`LOST`): a chunk that keeps
    # failing one kind of work is given up; faults of different roles do not add up
    attempts: collections.Counter = field(default_factory=collections.Counter)
    # filled as the chunk moves through the pipeline
    facts: list[SampleFacts] | None = None  # per sample, what the driver reads
    samples_ref: Any = None  # the samples' object: read by the reference, the scorer and the learner
    ref_logprobs_ref: Any = None  # the reference logprobs' object: read by the learner
    scores: Any = None  # ScoreBatch (small: fetched by the driver)
    sampling: Any = None  # a SamplingConfig overriding the worker's own (evaluation chunks)
    eval: bool = False  # a held-out evaluation chunk: scored by the reward only, never buffered or trained
    round: int = 0  # bumped when the samples are lost: results of an older round are ignored
    admitted: int = 0  # async: the learner version when the chunk was admitted (stale_policy 'wait')

    def lost(self) -> None:
        """The samples are gone: forget every result and start a new round."""
        self.facts = self.samples_ref = self.ref_logprobs_ref = self.scores = None
        self.round += 1

    @property
    def version(self) -> int:
        return min(f.version for f in self.facts) if self.facts else -1


# A learner batch, as both pipelines hand it over: (chunk, sample positions) in chunk order.
Parts = list[tuple[Chunk, list[int]]]


def every_sample(chunks: list[Chunk]) -> Parts:
    """`chunks` with all their samples, as `Parts`."""
    return [(c, list(range(len(c.facts)))) for c in chunks]


def kept(parts: Parts) -> list[tuple[Chunk, int]]:
    """(chunk, position) of every sample of `parts` whose reward did not fail: what is trained."""
    return [(c, j) for c, pos in parts for j in pos if c.scores.ok[j]]


def env_failed(chunk: Chunk, j: int) -> bool:
    """Sample j of `chunk` is a multi-turn episode whose environment failed (dropped like a failed reward,
    but counted against rollout.environment.max_failure_frac)."""
    e = chunk.facts[j].episode
    return e is not None and e.failed


def reward_errors(parts: Parts) -> list[str]:
    """The error of every sample of `parts` whose reward failed (dropped, never scored 0); episodes whose
    environment failed are counted by `env_errors` instead."""
    return [
        c.scores.errors[j] or "unknown reward error"
        for c, pos in parts
        for j in pos
        if not c.scores.ok[j] and not env_failed(c, j)
    ]


def env_errors(parts: Parts) -> list[str]:
    """'<status>: <error>' of every episode of `parts` whose environment failed."""
    return [
        f"{c.facts[j].episode.status}: {c.facts[j].episode.error}"
        for c, pos in parts
        for j in pos
        if env_failed(c, j)
    ]


@dataclass(kw_only=True)
class Faults:
    """The faults the collector met and handled while collecting (the async pipeline counts a step's in
    one of its own; a sync batch carries its own as a `RolloutBatch`)."""

    replacements: int = 0  # dead or stuck role actors replaced
    redispatched: int = 0  # pieces of work handed out again
    lost: int = 0  # chunks generated again because their samples' object was lost with its node
    events: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class RolloutBatch(Faults):
    """A generated and scored batch (`chunks`, in chunk order) and what happened on the way (its
    `Faults`, its times). Everything the driver computes from it (metrics, reward failures, the
    learner's shards) comes from the chunks' facts and scores."""

    chunks: list[Chunk] = field(default_factory=list)
    time_generate: float = 0.0
    time_score: float = 0.0
    queue_depth: int = 0  # most chunks generated and waiting for their scores at once
    # chunk index -> the positions trained (dynamic sampling leaves filtered groups out); None: all
    selected: dict[int, list[int]] | None = None

    @property
    def parts(self) -> Parts:
        """The samples trained, as the learner takes a batch (an async `Taken`'s parts): every sample
        of every chunk, or the `selected` positions."""
        if self.selected is None:
            return every_sample(self.chunks)
        return [(c, list(self.selected[c.index])) for c in self.chunks]

    @property
    def kept(self) -> list[tuple[Chunk, int]]:
        return kept(self.parts)

    def count_in(self, other: RolloutBatch) -> None:
        """Add what happened while collecting `other` (times, faults, events) to this batch's record."""
        self.time_generate += other.time_generate
        self.time_score += other.time_score
        self.queue_depth = max(self.queue_depth, other.queue_depth)
        self.replacements += other.replacements
        self.redispatched += other.redispatched
        self.lost += other.lost
        self.events += other.events

    @property
    def scores(self) -> np.ndarray:
        """Scores of the kept samples, in batch order."""
        return np.array([float(c.scores.scores[j]) for c, j in self.kept], dtype=np.float64)

    @property
    def total(self) -> int:
        """Samples generated, kept or not."""
        return sum(len(c.facts) for c in self.chunks)


def chunk_seed(run_seed: int, step: int, chunk: int) -> int:
    """Sampling seed that depends only on (run, step, chunk), not on which worker runs it."""
    return int(np.random.SeedSequence([run_seed, step, chunk]).generate_state(1)[0])
