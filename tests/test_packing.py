"""The exact check of whether bundles fit on nodes (no Ray needed): cases worked by hand, and a
property test against brute force over every assignment."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.placement.packing import UNIT, PackingUndecided, pack


def cpus(*amounts: float) -> list[dict[str, float]]:
    return [{"CPU": a} for a in amounts]


def valid(items, nodes, chosen) -> bool:
    for j, node in enumerate(nodes):
        held = [items[i] for i in range(len(items)) if chosen[i] == j]
        for key in {k for item in items for k in item}:
            if round(sum(item.get(key, 0.0) for item in held) * UNIT) > round(node.get(key, 0.0) * UNIT):
                return False
    return True


def brute_force(items, nodes) -> bool:
    return any(valid(items, nodes, c) for c in itertools.product(range(len(nodes)), repeat=len(items)))


def test_the_issue_plan_fits_three_one_cpu_nodes():
    # learner 1 CPU, two workers 0.5, reference and scorer 0.25: 2.5 CPUs on 3 x 1 CPU
    items, nodes = cpus(1.0, 0.5, 0.5, 0.25, 0.25), cpus(1, 1, 1)
    chosen = pack(items, nodes)
    assert chosen is not None and valid(items, nodes, chosen)
    assert chosen.count(chosen[0]) == 1  # the learner's CPU is a whole node's


def test_bundles_that_fit_one_by_one_but_not_together_are_refused():
    assert pack(cpus(0.6, 0.6, 0.6), cpus(1, 1)) is None  # 1.8 <= 2 CPUs, yet no node holds two
    assert pack(cpus(1, 1, 1, 1), cpus(1, 1, 1)) is None  # more than the cluster has
    assert pack(cpus(2), cpus(1, 1, 1)) is None  # one bundle bigger than any node


def test_an_exact_answer_where_first_fit_decreasing_gives_up():
    # First fit, largest first: 0.4+0.4 | 0.3+0.3+0.3 leaves a 0.3 out; 0.4+0.3+0.3 twice fits.
    items, nodes = cpus(0.4, 0.4, 0.3, 0.3, 0.3, 0.3), cpus(1, 1)
    chosen = pack(items, nodes)
    assert chosen is not None and valid(items, nodes, chosen)


def test_custom_resources_pin_bundles_to_node_types():
    nodes = [{"CPU": 1, "learner_node": 1}, {"CPU": 1, "rollout_node": 1}, {"CPU": 1}]
    items = [{"CPU": 1, "learner_node": 1}, {"CPU": 0.5, "rollout_node": 1}, {"CPU": 0.25}]
    chosen = pack(items, nodes)
    assert chosen[:2] == [0, 1]
    assert pack([{"CPU": 0.1, "rollout_node": 1}] * 2, nodes) is None  # one rollout node, one slot
    assert pack([{"CPU": 0.1, "GPU": 1}], nodes) is None  # no GPUs at all


def test_a_search_past_its_budget_says_so():
    with pytest.raises(PackingUndecided):
        pack(cpus(*[0.3] * 7), cpus(*[1] * 3), budget=5)  # 2.1 CPUs, but only 3 per node fit


amount = st.sampled_from([0.0, 0.25, 0.3, 0.5, 0.6, 1.0])


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.fixed_dictionaries({"CPU": amount, "GPU": amount}), min_size=1, max_size=5),
    nodes=st.lists(
        st.fixed_dictionaries({"CPU": st.sampled_from([0.5, 1.0, 1.5]), "GPU": st.sampled_from([0.0, 1.0])}),
        min_size=1,
        max_size=3,
    ),
)
def test_pack_agrees_with_brute_force(items, nodes):
    chosen = pack(items, nodes)
    assert (chosen is not None) == brute_force(items, nodes)
    if chosen is not None:
        assert valid(items, nodes, chosen)
