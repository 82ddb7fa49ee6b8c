"""The algorithm registries (learner.registry) are the one list of each part: the config's allowed
values, its rules and the configuration reference are read from them, and every registered name
reaches a function with the registry's signature."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from cluster.config.schema import ConfigError, build_config
from learner.config import KLConfig, LearnerConfig
from learner.registry import (
    ADVANTAGES,
    KL_ESTIMATORS,
    LOSS_AGGS,
    OFF_POLICY,
    POLICY_LOSSES,
    Part,
    Registry,
)

TREE = {"model": {"policy_path": "p"}, "data": {"prompts_path": "x.jsonl"}, "reward": {"model_path": "r"}}
FIELDS = [
    (ADVANTAGES, LearnerConfig, "advantage"),
    (POLICY_LOSSES, LearnerConfig, "policy_loss"),
    (LOSS_AGGS, LearnerConfig, "loss_agg"),
    (KL_ESTIMATORS, KLConfig, "estimator"),
    (KL_ESTIMATORS, KLConfig, "loss_estimator"),
]


@pytest.mark.parametrize("registry,model,field", FIELDS, ids=[f for *_, f in FIELDS])
def test_the_config_allows_exactly_the_registered_names(registry, model, field):
    assert typing.get_args(model.model_fields[field].annotation) == registry.names()
    with pytest.raises(ValueError, match=field):
        model(**{field: "not-registered"})


def test_the_off_policy_setting_is_auto_or_a_registered_correction():
    """learner.off_policy allows 'auto' (decided by the run config) and exactly OFF_POLICY's names."""
    assert typing.get_args(LearnerConfig.model_fields["off_policy"].annotation) == (
        "auto",
        *OFF_POLICY.names(),
    )
    assert OFF_POLICY.field == "learner.off_policy"
    with pytest.raises(ValueError, match="off_policy"):
        LearnerConfig(off_policy="not-registered")


@pytest.mark.parametrize("registry", [ADVANTAGES, POLICY_LOSSES, LOSS_AGGS, KL_ESTIMATORS, OFF_POLICY])
def test_every_part_reaches_a_function_with_the_registrys_signature(registry):
    arity = {
        "advantage estimator": 2,
        "policy loss": 5,
        "loss aggregation": 3,
        "KL estimator": 1,
        "off-policy correction": 1,
    }[registry.kind]
    for part in registry:
        fn = registry.function(part.name)
        assert callable(fn) and len(inspect.signature(fn).parameters) == arity, part.name
        assert part.summary and part.summary in registry.describe()


def test_the_configuration_reference_lists_every_part_with_its_summary():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "config-reference.md").read_text()
    for registry in (ADVANTAGES, POLICY_LOSSES, LOSS_AGGS, KL_ESTIMATORS, OFF_POLICY):
        for part in registry:
            cell = f"'{part.name}': {part.summary}".replace("|", "\\|")  # as a Markdown cell writes it
            assert cell in doc, part.name


def test_a_name_registered_twice_or_unknown_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="registered twice"):
        Registry(
            "x",
            "learner.x",
            [Part(name="a", function="m:f", summary=""), Part(name="a", function="m:g", summary="")],
        )
    with pytest.raises(
        ValueError, match=r"unknown policy loss 'ppo2' \(learner.policy_loss\); allowed: ppo, gspo"
    ):
        POLICY_LOSSES["ppo2"]


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_the_config_rules_follow_each_estimators_needs(name):
    """A critic allows bootstrapping truncated responses; groups need n >= 2; an estimator that
    corrects for the behaviour policy itself resolves off_policy 'auto' to 'none' on stale samples."""
    est = ADVANTAGES[name]
    learner = {"advantage": name}
    if est.groups:
        with pytest.raises(ConfigError, match="rollout.sampling.n >= 2"):
            build_config({**TREE, "learner": learner})
    sampled = {"rollout": {"sampling": {"n": 2}}}
    assert build_config({**TREE, **sampled, "learner": learner}).learner.advantage == name
    if est.critic:
        assert LearnerConfig(advantage=name, truncation="bootstrap").truncation == "bootstrap"
    else:
        with pytest.raises(ValueError, match="needs a critic"):
            LearnerConfig(advantage=name, truncation="bootstrap")
    stale = {"pipeline": {"mode": "async", "max_staleness": 1}}
    resolved = build_config({**TREE, **sampled, **stale, "learner": learner}).resolved.off_policy
    assert resolved == ("none" if est.corrects_off_policy else "tis")


def test_a_policy_loss_defined_with_one_aggregation_needs_it():
    with pytest.raises(ValueError, match="learner.loss_agg: seq-mean-token-mean"):
        LearnerConfig(policy_loss="gspo")
    assert LearnerConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean").policy_loss == "gspo"


def test_dr_grpos_constant_is_the_longest_response_a_run_can_sample():
    dr = {"advantage": "grpo", "grpo": {"norm_adv_by_std": False}, "loss_agg": "seq-mean-token-sum-norm"}
    rollout = {"sampling": {"n": 4, "max_new_tokens": 24}}
    assert build_config({**TREE, "rollout": rollout, "learner": dr}).resolved.loss_norm_tokens == 24
    given = build_config({**TREE, "rollout": rollout, "learner": {**dr, "loss_norm_tokens": 100}})
    assert given.resolved.loss_norm_tokens == 100
    # another aggregation leaves it unset (unused)
    plain = build_config({**TREE, "rollout": rollout, "learner": {"advantage": "grpo"}})
    assert plain.resolved.loss_norm_tokens is None


def test_parts_are_frozen_records():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ADVANTAGES["gae"].critic = False


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_an_estimators_parameters_are_the_block_its_entry_declares(name):
    """learner.<estimator> exists exactly for an estimator whose entry declares a block, holds fields of
    `AdvantageParams` (the prepared settings take them by name), reads its defaults when unset, and is
    refused, naming the field that selects it, when another estimator is selected."""
    from learner.advantages import AdvantageParams
    from learner.prepare import advantage_params

    est = ADVANTAGES[name]
    if est.section is None:
        assert name not in LearnerConfig.model_fields
        assert LearnerConfig(advantage=name).params(name) is None
        return
    model = typing.get_args(LearnerConfig.model_fields[name].annotation)[0]
    assert set(model.model_fields) <= {f.name for f in dataclasses.fields(AdvantageParams)}
    assert LearnerConfig(advantage=name).params(name) == model()
    other = next(e for e in ADVANTAGES.names() if e != name)
    with pytest.raises(ValueError, match=rf"learner.{name} is read only with learner.advantage: {name} "):
        LearnerConfig(advantage=other, **{name: {}})
    # every field of the block reaches the estimator's settings
    values = {
        f: (not v.default) if isinstance(v.default, bool) else 0.5 for f, v in model.model_fields.items()
    }
    settings = advantage_params(LearnerConfig(advantage=name, **{name: values}), "cpu")
    assert {f: getattr(settings, f) for f in values} == values


def test_the_vtrace_block_sets_every_vtrace_parameter():
    cfg = LearnerConfig(advantage="vtrace", vtrace={"rho_clip": 2.0, "c_clip": 0.5, "lam": 0.9})
    assert cfg.params("vtrace") == cfg.vtrace
    assert (cfg.vtrace.rho_clip, cfg.vtrace.c_clip, cfg.vtrace.lam) == (2.0, 0.5, 0.9)


@pytest.mark.parametrize(
    "old,new",
    [
        ("lam", "learner.gae.lam (advantage gae) and learner.vtrace.lam (advantage vtrace)"),
        ("group_std_normalize", "learner.grpo.norm_adv_by_std"),
        ("vtrace_rho_clip", "learner.vtrace.rho_clip"),
        ("vtrace_c_clip", "learner.vtrace.c_clip"),
        ("off_policy_cap", "learner.tis.cap (off_policy tis) and learner.mask.cap (off_policy mask)"),
        ("off_policy_geo_bounds", "learner.geo_mask.bounds (off_policy geo_mask)"),
        ("overlong_buffer", "learner.overlong.buffer"),
        ("overlong_filter", "learner.overlong.filter"),
        ("clip_eps", "learner.clip.eps"),
        ("clip_eps_high", "learner.clip.eps_high"),
        ("dual_clip", "learner.clip.dual"),
    ],
)
def test_a_field_that_moved_into_a_block_is_refused_naming_its_new_place(old, new):
    import re

    with pytest.raises(ConfigError, match=re.escape(f"learner.{old} moved to {new}")):
        build_config({**TREE, "learner": {old: 1.0}})


def test_a_learner_section_with_its_blocks_loads_again_from_its_dump():
    """A run's saved config (every field written, the unselected blocks null) validates again unchanged."""
    cfg = build_config({**TREE, "learner": {"advantage": "vtrace", "vtrace": {"rho_clip": 2.0}}}).learner
    assert LearnerConfig(**cfg.model_dump()) == cfg
    assert LearnerConfig(**LearnerConfig().model_dump()) == LearnerConfig()


@pytest.mark.parametrize("name", OFF_POLICY.names())
def test_an_off_policy_presets_parameters_are_the_block_its_entry_declares(name):
    """learner.<preset> exists exactly for a preset whose entry declares a block, reads its defaults when
    unset, and is refused naming learner.off_policy unless off_policy names the preset ('auto' included:
    it may decide on another)."""
    part = OFF_POLICY[name]
    if part.section is None:
        assert name not in LearnerConfig.model_fields
        return
    field = part.block_field  # the preset's name, or the field its entry names ('custom': rollout_correction)
    model = typing.get_args(LearnerConfig.model_fields[field].annotation)[0]
    if part.section_required:
        with pytest.raises(ValueError, match=rf"learner.off_policy='{name}' needs learner.{field} \("):
            LearnerConfig(off_policy=name)
    else:
        assert LearnerConfig(off_policy=name).params(name) == model()
    assert LearnerConfig(off_policy=name, **{field: {}}).params(name) == model()
    for other in ("auto", "none"):
        with pytest.raises(
            ValueError, match=rf"learner.{field} is read only with learner.off_policy: {name} "
        ):
            LearnerConfig(off_policy=other, **{field: {}})
