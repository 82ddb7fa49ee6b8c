"""Samples of one prompt form a group; group-baseline estimators (grpo, rloo) need each group whole.

A group is a run of consecutive samples of the same prompt from the same chunk (a worker returns a
prompt's n samples together, and batches keep chunk order). Sharding a batch over learner ranks moves
each cut of an even split forward to the next group boundary, so no group is split between ranks
and its baseline is the one a single process would compute. With one sample per prompt every index
is a boundary and the shards are exactly `numpy.array_split`'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

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
