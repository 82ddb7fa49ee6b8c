"""Pure bookkeeping of issue 22: micro-batches under a token budget (learner.micro_batches) and learner
shards balanced by tokens (cluster.groups): cases worked by hand and hypothesis properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.records.groups import max_load, shard_batch, shard_by_cost, shard_by_group
from learner.micro_batches import micro_batch_cost, plan_micro_batches


def test_count_based_cut_keeps_order():
    assert plan_micro_batches([5, 1, 9, 2, 2], max_rows=2) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches([], max_rows=2) == []


def test_token_budget_worked_by_hand():
    lengths = [10, 3, 7, 2, 6]
    # packed: first-fit decreasing on sums: 10 | 7+3 (10) | 6+2 (8)
    assert plan_micro_batches(lengths, max_rows=1, max_tokens=10, packed=True) == [[0], [1, 2], [3, 4]]
    # padded: a micro-batch costs rows x its longest. Longest first: 10 | 7 (10+7 would be 2 x 10)
    # | 6 joins 7 (2 x 7 = 14) | 3 fits neither (20, 3 x 7 = 21): new | 2 joins 3 (2 x 3 = 6)
    assert plan_micro_batches(lengths, max_rows=1, max_tokens=18, packed=False) == [[0], [2, 4], [1, 3]]


def test_a_sequence_over_the_budget_names_the_field():
    with pytest.raises(ValueError, match=r"learner.max_tokens_per_micro_batch=8 is below a sequence of 9"):
        plan_micro_batches([3, 9], max_rows=4, max_tokens=8)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=60),
    budget=st.integers(300, 2000),
    packed=st.booleans(),
)
def test_every_row_once_and_no_micro_batch_over_budget(lengths, budget, packed):
    plan = plan_micro_batches(lengths, max_rows=1, max_tokens=budget, packed=packed)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert all(mb == sorted(mb) and mb for mb in plan)
    assert all(micro_batch_cost([lengths[i] for i in mb], packed) <= budget for mb in plan)


def test_shards_by_cost_worked_by_hand():
    # groups (costs): g0 (50+50) g1 (10) g2 (10) g3 (10) g4 (10) -> 100 | 40 instead of the even cut
    groups = [0, 0, 1, 2, 3, 4]
    costs = [50, 50, 10, 10, 10, 10]
    even = shard_by_group(groups, 2)
    assert [s.tolist() for s in even] == [[0, 1, 2], [3, 4, 5]]  # loads 110 | 30
    balanced = shard_by_cost(groups, costs, 2)
    assert [s.tolist() for s in balanced] == [[0, 1], [2, 3, 4, 5]]  # loads 100 | 40
    assert [s.tolist() for s in shard_batch(groups, costs, 2, "count")] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="learner.balance_ranks='flops'; allowed"):
        shard_batch(groups, costs, 2, "flops")


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=30),
    ranks=st.integers(1, 5),
    seed=st.integers(0, 2**31),
    tail=st.floats(1.0, 50.0),
)
def test_balanced_shards_keep_groups_whole_and_never_lose_to_the_even_split(sizes, ranks, seed, tail):
    """Random group sizes and long-tail lengths (log-normal, the longest up to ~`tail`x the median)."""
    groups = [g for g, n in enumerate(sizes) for _ in range(n)]
    rng = np.random.default_rng(seed)
    costs = np.ceil(np.exp(rng.normal(4.0, np.log(tail) / 2.5, len(groups)))).astype(int).tolist()
    shards = shard_by_cost(groups, costs, ranks)
    assert len(shards) == ranks
    assert sorted(i for s in shards for i in s.tolist()) == list(range(len(groups)))
    owner = {}
    for k, s in enumerate(shards):
        assert s.tolist() == sorted(s.tolist())
        for i in s.tolist():
            assert owner.setdefault(groups[i], k) == k  # a group never split
    assert max_load(shards, costs) <= max_load(shard_by_group(groups, ranks), costs)
