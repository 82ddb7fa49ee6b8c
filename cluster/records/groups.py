"""Samples of one prompt form a group; group-baseline estimators (grpo, rloo) need each group whole.

A group is a run of consecutive samples of the same prompt from the same chunk (a worker returns a
prompt's n samples together, and batches keep chunk order). Sharding a batch over learner ranks moves
each cut of an even split forward to the next group boundary, so no group is split between ranks
and its baseline is the one a single process would compute. With one sample per prompt every index
is a boundary and the shards are exactly `numpy.array_split`'s.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np


def group_runs(keys: Sequence[Hashable]) -> list[int]:
    """Group id (0, 1, ...) of each item: consecutive items with equal keys share one."""
    ids: list[int] = []
    for i, key in enumerate(keys):
        ids.append(0 if i == 0 else ids[-1] + (key != keys[i - 1]))
    return ids


def shard_by_group(groups: Sequence[int], num_shards: int) -> list[np.ndarray]:
    """`num_shards` contiguous index arrays over `groups`, as even as whole groups allow (some may be empty)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    n = len(groups)
    even = np.cumsum([len(s) for s in np.array_split(np.arange(n), num_shards)])[:-1]
    starts = [i for i in range(1, n) if groups[i] != groups[i - 1]] + [n]  # group boundaries
    cuts = [0]
    for target in even:
        cut = next(b for b in starts if b >= max(int(target), cuts[-1]))
        cuts.append(cut)
    cuts.append(n)
    return [np.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def max_load(shards: Sequence[np.ndarray], costs: Sequence[float]) -> float:
    """The cost of the most loaded shard (what sets a step's time when ranks wait for each other)."""
    c = np.asarray(costs, dtype=np.float64)
    return max((float(c[s].sum()) for s in shards), default=0.0)


def shard_by_cost(groups: Sequence[int], costs: Sequence[float], num_shards: int) -> list[np.ndarray]:
    """`num_shards` index arrays over `groups` balancing the summed `costs` (e.g. tokens per sequence).

    Whole groups, largest first, each onto the least-loaded shard (fewest items breaks ties): the
    longest-processing-time rule, within 4/3 of the best possible maximum load. The even contiguous
    split of `shard_by_group` is kept where its maximum load is lower, so the result is never worse
    than it. Each shard's indices are ascending (batch order)."""
    if len(costs) != len(groups):
        raise ValueError(f"{len(costs)} costs for {len(groups)} items")
    even = shard_by_group(groups, num_shards)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    c = np.asarray(costs, dtype=np.float64)
    load = np.zeros(num_shards)
    count = np.zeros(num_shards, dtype=np.int64)
    picked: list[list[int]] = [[] for _ in range(num_shards)]
    for items in sorted(members.values(), key=lambda m: (-float(c[m].sum()), m[0])):
        s = min(range(num_shards), key=lambda k: (load[k], count[k], k))
        picked[s].extend(items)
        load[s] += float(c[items].sum())
        count[s] += len(items)
    greedy = [np.array(sorted(p), dtype=np.int64) for p in picked]
    return greedy if max_load(greedy, c) < max_load(even, c) else even


def shard_batch(groups: Sequence[int], tokens: Sequence[int], num_shards: int, how: str) -> list[np.ndarray]:
    """The learner ranks' shards by `learner.balance_ranks`: 'tokens' (`shard_by_cost` on prompt +
    response tokens) or 'count' (`shard_by_group`)."""
    if how == "tokens":
        return shard_by_cost(groups, tokens, num_shards)
    if how == "count":
        return shard_by_group(groups, num_shards)
    raise ValueError(f"learner.balance_ranks={how!r}; allowed: 'tokens', 'count'")


class RankPart(NamedTuple):
    """Consecutive samples of one chunk as a learner rank takes them (`train_parts`)."""

    samples_ref: Any  # the chunk's samples object
    ref_logprobs_ref: Any  # its reference logprobs object
    picks: list[tuple[int, float, int]]  # (sample position, score, group id)
    turn_rewards: bool  # the chunk's `ScoreBatch.turn_rewards`: episodes train their earlier turns' rewards


class LostInputs(NamedTuple):
    """What every learner rank answers for a step that trained nothing anywhere, because some rank's input
    object was lost with its node (the ranks agree before their first collective): the positions in this
    rank's own parts whose objects are gone. A step that trained answers its metrics (a dict) instead."""

    parts: list[int]


def shard_parts(
    parts: Sequence[tuple[Any, Sequence[int]]], num_shards: int, how: str
) -> list[tuple[list[RankPart], list]]:
    """A learner batch split over `num_shards` ranks as each rank's `train_parts` argument.

    `parts` is the batch as both pipelines hand it over: (chunk, sample positions) in chunk order,
    the chunks as `cluster.pipeline.collector.Chunk` (facts, scores, prompts and the two object references).
    Samples whose reward failed are left out; groups (a prompt's run of samples in one chunk) stay
    whole and shards balance tokens (`shard_batch`). Consecutive samples of one chunk travel as one
    `RankPart`. Returns per rank (its parts, the chunk of each part: a rank names a lost input by its
    part's position)."""
    items = [(chunk, j) for chunk, pos in parts for j in pos if chunk.scores.ok[j]]
    group = group_runs([(chunk.index, chunk.facts[j].prompt_index) for chunk, j in items])
    prompt_len = {(c.index, p.index): len(p.ids) for c, _ in parts for p in c.prompts}
    tokens = [
        prompt_len[chunk.index, chunk.facts[j].prompt_index] + chunk.facts[j].length for chunk, j in items
    ]
    out = []
    for shard in shard_batch(group, tokens, num_shards, how):
        runs = [
            (chunk, list(run))
            for chunk, run in itertools.groupby(((k, items[k]) for k in shard), key=lambda it: it[1][0])
        ]
        args = [
            RankPart(
                chunk.samples_ref,
                chunk.ref_logprobs_ref,
                [(j, float(chunk.scores.scores[j]), group[k]) for k, (_, j) in run],
                bool(chunk.scores.turn_rewards),
            )
            for chunk, run in runs
        ]
        out.append((args, [chunk for chunk, _run in runs]))
    return out
