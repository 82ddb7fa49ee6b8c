"""The roles' registry (`cluster.roles.registry`) against the parts it describes: each role's
constructor arguments fit its actor class, its resources and counts are the config's, and the
collector's calls follow the roles a run runs (no reference call where the learner computes it)."""

from __future__ import annotations

import inspect

from test_config import tree

from cluster.config.schema import build_config
from cluster.pipeline.collector import RolloutCollector
from cluster.placement.plan import role_shapes
from cluster.roles.registry import (
    ROLES,
    SCALABLE,
    WORK,
    Place,
    Resources,
    generate_kind,
    running,
    scoring_kinds,
)

BUILT_IN = ("learner", "rollout", "reference", "reward", "judge")  # a role added later: no change here


def _built_in(names) -> list[str]:
    """`names` in their order, those of the built-in roles only."""
    return [n for n in names if n in BUILT_IN]


def _cfg(**sections):
    return build_config(tree(**sections))  # test_config's minimal run config, with `sections` merged in


def test_each_roles_arguments_bind_to_its_actor_classs_constructor():
    cfg = _cfg()
    for role in ROLES:
        place = Place(1, cfg.rollout, None, 0)
        inspect.signature(role.actor_class()).bind(*role.args(cfg, place))  # raises on a mismatch


def test_counts_and_resources_are_the_configs_and_the_plan_reads_them():
    cfg = _cfg(
        rollout={"num_workers": 3, "num_cpus_per_worker": 0.5, "resources": {"gen": 1.0}},
        reference={"num_replicas": 2, "num_gpus": 0.5},
        learner={"num_ranks": 2},
        data={"prompts_per_step": 8},
    )
    counts = {r.name: r.count(cfg) for r in ROLES if r.name in BUILT_IN}
    assert counts == {"learner": 2, "rollout": 3, "reference": 2, "reward": 1, "judge": 1}
    shapes = role_shapes(cfg)
    assert [shapes[r.name].prefix for r in ROLES] == [r.prefix for r in ROLES]
    assert {name: s.count for name, s in shapes.items() if name in BUILT_IN} == {
        **counts,
        "judge": 0,
    }  # reward.kind='model'
    assert shapes["rollout"].bundle() == {"CPU": 0.5, "gen": 1.0}
    assert shapes["reference"].bundle() == {"CPU": 0.25, "GPU": 0.5}
    assert _built_in(r.name for r in SCALABLE) == ["rollout", "reference", "reward", "judge"]
    judged = _cfg(
        reward={"kind": "judge", "judge": {"model_path": "/j", "num_replicas": 3, "num_gpus": 1.0}},
        data={"prompts_per_step": 8},
    )
    shapes = role_shapes(judged)
    assert shapes["judge"].count == 3 and shapes["judge"].bundle() == {"CPU": 0.25, "GPU": 1.0}
    assert shapes["reward"].count == 0  # the judge scores; no reward scorer runs


def test_the_collector_calls_only_the_roles_the_run_runs():
    generate = generate_kind()
    assert generate == "generate" and WORK[generate].reads == "prompts"
    assert _built_in(scoring_kinds(train=True)) == ["reference", "reward", "judge"]
    assert _built_in(scoring_kinds(train=False)) == ["reward", "judge"]  # held-out chunks need no reference
    for lora, with_reference in ((0, True), (4, False)):
        cfg = _cfg(learner={"lora": {"rank": lora}})
        names = [r.name for r in running(cfg)]
        assert ("reference" in names) == with_reference
        assert (role_shapes(cfg)["reference"].count == 1) == with_reference
        collector = RolloutCollector({name: object() for name in names}, cfg.timeouts)
        assert collector.after_generate(train=True) == (("reference",) if with_reference else ()) + (
            "reward",
        )
        assert set(collector.timeouts) == {generate, *collector.after_generate(train=True)}
    judged = _cfg(reward={"kind": "judge", "judge": {"model_path": "/j"}})
    names = [r.name for r in running(judged)]
    assert names == ["rollout", "reference", "judge"]
    collector = RolloutCollector({name: object() for name in names}, judged.timeouts)
    assert collector.after_generate(train=True) == ("reference", "judge")
    assert collector.after_generate(train=False) == ("judge",)


def _needed(kind) -> dict:
    """The reward section of `kind` with its first needed field set ("judge.model_path" -> nested)."""
    section: dict = {"kind": kind.name}
    if kind.needs:
        *parents, leaf = kind.needs[0].split(".")
        node = section
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = "/x"
    return section


def test_a_reward_kind_of_its_own_role_names_a_role_of_the_registry_with_its_section():
    """`RewardKind.own_role` names the role that scores the kind (its section `reward.<kind>`): that role
    runs and the reward scorers do not, for exactly the kinds that name it."""
    from cluster.roles.registry import BY_NAME, REWARD
    from reward_service.backends import REWARD_KINDS

    own = [k for k in REWARD_KINDS if k.own_role is not None]
    assert {k.own_role for k in own} >= {"judge"}  # a kind added later: no change here
    for kind in own:
        assert BY_NAME[kind.own_role].config_section == f"reward.{kind.name}"
        cfg = _cfg(reward=_needed(kind))
        assert BY_NAME[kind.own_role].runs(cfg) and not REWARD.runs(cfg)
        others = [r for r in SCALABLE if r.name != kind.own_role and r.config_section.startswith("reward.")]
        assert not any(r.runs(cfg) for r in others)
    cfg = _cfg()
    assert REWARD.runs(cfg) and not any(BY_NAME[k.own_role].runs(cfg) for k in own)


def test_the_judge_is_its_kinds_standard_reward_role_but_for_its_actor_class():
    """A kind whose role is described nowhere (`reward_role`): the scorer's actor with the kind's backend,
    counted and sized by `reward.<kind>`, scalable, its call kind its name, filed as the chunk's scores.
    The judge is that role with its own actor class (which builds its engine's model) and arguments."""
    from cluster.roles.registry import JUDGE, reward_role
    from cluster.roles.role import file_scores, send_scores
    from reward_service.backends import REWARD_KINDS

    standard = reward_role(REWARD_KINDS["judge"])
    cfg = _cfg(
        reward={
            "kind": "judge",
            "judge": {
                "model_path": "/j",
                "num_replicas": 3,
                "num_cpus": 2,
                "num_gpus": 1,
                "resources": {"r": 1},
            },
        }
    )
    assert standard.function == "cluster.roles.actors:StreamingScorer"
    assert (
        (standard.count(cfg), standard.resources(cfg))
        == (3, JUDGE.resources(cfg))
        == (3, Resources(2, 1, {"r": 1}))
    )
    assert standard.args(cfg, Place(slot=0)) == (cfg.scorer_reward, cfg.tokenizer_path)
    assert (standard.prefix, standard.scalable, standard.section) == ("reward-judge", True, "reward.judge")
    assert (standard.work.kind, standard.work.send, standard.work.file) == ("judge", send_scores, file_scores)
    assert standard.runs(cfg) and not standard.runs(_cfg())
    assert JUDGE.function == "cluster.roles.actors:StreamingJudge"
    assert JUDGE.args(cfg, Place(slot=0)) == (cfg.reward, cfg.tokenizer_path)
    assert (JUDGE.count(cfg), JUDGE.prefix, JUDGE.work.kind, JUDGE.section) == (
        3,
        "reward-judge",
        "judge",
        "reward.judge",
    )


def test_the_stream_collectors_tracker_takes_the_registered_call_kinds_and_refuses_another():
    """A call kind is one the registry declares (`call_kinds()`: the driver's own and each role's work):
    a misspelled kind is refused where the call is added, naming it, instead of becoming a call that
    nobody waits for."""
    import pytest

    from cluster.pipeline.collector import StreamCollector
    from cluster.roles.registry import CallKind, call_kinds

    assert call_kinds() == frozenset(CallKind) | {r.work.kind for r in ROLES if r.work is not None}
    cfg = _cfg()
    collector = StreamCollector({r.name: object() for r in running(cfg)}, cfg.timeouts)
    call = collector.tracker.add("rollout-worker-0", object(), CallKind.GENERATE, 1.0)
    assert call.kind == "generate" and collector.tracker.pending("rollout-worker-0", CallKind.GENERATE) == 1
    with pytest.raises(ValueError, match=r"unknown call kind 'generation'; tracked: export, generate, judge"):
        collector.tracker.add("rollout-worker-0", object(), "generation", 1.0)


def test_a_roles_call_kind_is_its_own_and_none_of_the_drivers():
    """Each role's work names a kind no other role's work and none of the driver's own calls take, so a
    role described in a module of its own cannot take over another's calls; the check names the role."""
    import dataclasses

    import pytest

    from cluster.roles.registry import JUDGE, REWARD, CallKind, _work
    from kernel.registry import Registry

    same = dataclasses.replace(
        JUDGE, name="judge2", work=dataclasses.replace(JUDGE.work, kind=CallKind.REWARD)
    )
    with pytest.raises(
        ValueError, match=r"role 'judge2': call kind 'reward' is already the kind of role 'reward'"
    ):
        _work(Registry("role", "cluster.scale", [REWARD, same]))
    drivers = dataclasses.replace(JUDGE, work=dataclasses.replace(JUDGE.work, kind=CallKind.TRAIN))
    with pytest.raises(
        ValueError, match=r"role 'judge': call kind 'train' is already the kind of the driver's own calls"
    ):
        _work(Registry("role", "cluster.scale", [REWARD, drivers]))
    own = dataclasses.replace(JUDGE, name="remote", work=dataclasses.replace(JUDGE.work, kind="remote"))
    assert list(_work(Registry("role", "cluster.scale", [REWARD, own]))) == ["reward", "remote"]
