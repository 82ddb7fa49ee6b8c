"""The placement plan's bookkeeping and the role resources in the config (no Ray cluster needed;
the plan on real multi-node clusters is tested in test_multinode.py)."""

from __future__ import annotations

import os

import pytest

from cluster.config.schema import ConfigError, build_config
from cluster.placement.plan import PlacementPlan, demand
from cluster.train import local_resources


def _cfg(**sections):
    tree = {
        "model": {"policy_path": "p"},
        "data": {"prompts_path": "x.jsonl"},
        "reward": {"kind": "rule", "rule": "exact_match"},
    }
    for name, section in sections.items():
        tree[name] = {**tree.get(name, {}), **section}
    return build_config(tree)


PINNED = {
    "learner": {"num_ranks": 2, "num_cpus_per_rank": 1.0, "resources": {"learner_node": 1}},
    "rollout": {"num_workers": 2, "num_cpus_per_worker": 0.5, "resources": {"rollout_node": 1}},
    "reference": {"num_cpus": 0.25, "resources": {"reward_node": 0.5}},
}


def test_learner_bundles_come_first_and_every_role_has_one_per_actor():
    plan = PlacementPlan(_cfg(**PINNED))
    assert plan.bundles == [
        {"CPU": 1.0, "learner_node": 1},
        {"CPU": 1.0, "learner_node": 1},
        {"CPU": 0.5, "rollout_node": 1},
        {"CPU": 0.5, "rollout_node": 1},
        {"CPU": 0.25, "reward_node": 0.5},
        {"CPU": 0.25},  # the reward scorer (no resources of its own)
    ]
    assert [plan.bundle_index("learner", r) for r in (0, 1)] == [0, 1]
    assert plan.options("rollout", 0) == {"num_cpus": 0.5, "num_gpus": 0.0, "resources": {"rollout_node": 1}}
    assert plan.asked() == (
        "2 x learner-rank {CPU: 1, learner_node: 1}; 2 x rollout-worker {CPU: 0.5, rollout_node: 1}; "
        "1 x reference {CPU: 0.25, reward_node: 0.5}; 1 x reward-scorer {CPU: 0.25}"
    )


def test_slots_keep_their_bundle_and_scaled_down_slots_give_it_back():
    plan = PlacementPlan(_cfg(**PINNED))
    assert [plan.bundle_index("rollout", s) for s in (0, 1)] == [2, 3]
    assert plan.bundle_index("rollout", 0) == 2  # a replacement in slot 0 takes slot 0's bundle
    assert plan.bundle_index("rollout", 2) is None  # beyond the plan: scheduled by Ray directly
    plan.release("rollout", 1)  # slot 1 scaled down
    assert plan.bundle_index("rollout", 3) == 3  # the next new worker gets its bundle
    plan.release("rollout", 2)  # never held one: nothing to give back
    assert plan.bundle_index("rollout", 4) is None


def test_a_local_ray_is_sized_to_the_plan_with_its_custom_resources():
    cfg = _cfg(**PINNED)
    want = {"CPU": 2 * 1.0 + 2 * 0.5 + 0.25 + 0.25, "learner_node": 2, "rollout_node": 2, "reward_node": 0.5}
    assert demand(cfg) == pytest.approx(want)
    cpus, custom = local_resources(cfg)
    assert cpus == max(os.cpu_count() or 1, 4)  # 3.5 CPUs asked: Ray wants whole ones
    assert custom == pytest.approx({"learner_node": 2, "rollout_node": 2, "reward_node": 0.5})


@pytest.mark.parametrize(
    ("section", "resources", "message"),
    [
        ("rollout", {"CPU": 1}, "rollout.resources: 'CPU' is set by the role's num_cpus/num_gpus"),
        ("learner", {"GPU": 1}, "learner.resources: 'GPU' is set by the role's num_cpus/num_gpus"),
        ("reward", {"reward_node": 0}, r"reward.resources.reward_node: must be > 0 \(got 0"),
        ("reference", {"reward_node": "many"}, "reference.resources.reward_node"),
    ],
)
def test_wrong_role_resources_name_the_field(section, resources, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**{section: {"resources": resources}})
