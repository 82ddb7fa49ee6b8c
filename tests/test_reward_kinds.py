"""The reward kinds (reward_service.backends) are the one list of them: the config's allowed values, its
rules and the configuration reference are read from the registry, every kind reaches a backend with the
one signature, and what cluster/ asks of a kind (which role scores, P(positive), held-out accuracy, turn
rewards, the driver's check) is a field of its entry."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import numpy as np
import pytest

from kernel.registry import resolve
from reward_service.backends import REWARD_KINDS, RewardKind, RoleSection, reward_to_prob, section_fields
from reward_service.config import RewardConfig, RewardFields

BUILT_IN = ("model", "rule", "remote", "judge", "environment")  # a kind added later needs no change here


def test_the_config_allows_exactly_the_registered_kinds():
    assert typing.get_args(RewardConfig.model_fields["kind"].annotation) == REWARD_KINDS.names()
    with pytest.raises(ValueError, match="kind"):
        RewardConfig(kind="not-registered")
    with pytest.raises(ValueError, match=r"unknown reward kind 'x' \(reward.kind\); allowed: model, rule"):
        REWARD_KINDS["x"]


@pytest.mark.parametrize("name", REWARD_KINDS.names())
def test_every_kind_reaches_a_backend_with_the_one_signature(name):
    cls = REWARD_KINDS.function(name)
    assert inspect.isclass(cls)
    assert list(inspect.signature(cls).parameters) == ["config", "model"]
    assert list(inspect.signature(cls.score).parameters) == ["self", "samples", "out"]
    kind = REWARD_KINDS[name]
    for target in (kind.probability, kind.check):
        assert target is None or callable(resolve(target))


def test_the_configuration_reference_lists_every_kind_with_its_summary():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "config-reference.md").read_text()
    for kind in REWARD_KINDS:
        assert f"'{kind.name}': {kind.summary}".replace("|", "\\|") in doc, kind.name


@pytest.mark.parametrize("kind", [k for k in REWARD_KINDS if k.needs])
def test_a_kind_without_its_needed_field_is_refused_naming_it(kind):
    message = RewardConfig(kind=kind.name).missing()
    assert message == (
        f"{' or '.join('reward.' + f for f in kind.needs)} is required when reward.kind={kind.name!r}"
    )


def test_the_reward_section_holds_each_kinds_declared_section_described_by_its_model():
    """`reward.<kind>` for every kind whose entry declares a section, read from the registry: the section's
    model, its docstring the field's description (the configuration reference's text)."""
    declared = {k.name: resolve(k.section) for k in REWARD_KINDS if k.section is not None}
    assert declared["judge"].__name__ == "JudgeConfig"
    fields = RewardConfig.model_fields
    assert list(fields) == [*RewardFields.model_fields, *declared]
    for name, model in declared.items():
        assert fields[name].annotation is model
        assert fields[name].description == " ".join(model.__doc__.split())
        assert isinstance(RewardConfig().model_dump()[name], dict)  # built by default


def test_a_kind_of_its_own_role_needs_a_section_with_the_roles_counts():
    bare = RewardKind(name="pool", function="reward_service.kind_remote:RemoteBackend", own_role="pool")
    with pytest.raises(ValueError, match=r"reward kind 'pool': own_role needs a section \(reward.pool\)"):
        section_fields(bare)
    wrong = RewardKind(
        name="pool", function="m:C", own_role="pool", section="reward_service.config:RewardFunctionConfig"
    )
    with pytest.raises(ValueError, match="lacks num_replicas, num_cpus, num_gpus, resources"):
        section_fields(wrong)
    ok = RewardKind(
        name="pool", function="m:C", own_role="pool", section="reward_service.backends:RoleSection"
    )
    assert section_fields(ok) == (RoleSection, " ".join(RoleSection.__doc__.split()))
    assert section_fields(RewardKind(name="plain", function="m:C")) is None


def test_the_kinds_needed_fields_are_those_the_config_had():
    missing = {k: RewardConfig(kind=k).missing() for k in BUILT_IN}
    assert missing == {
        "model": "reward.model_path is required when reward.kind='model'",
        "rule": "reward.rule or reward.functions is required when reward.kind='rule'",
        "remote": "reward.url is required when reward.kind='remote'",
        "judge": "reward.judge.model_path is required when reward.kind='judge'",
        "environment": None,
    }
    assert RewardConfig(kind="rule", rule="exact_match").missing() is None
    assert RewardConfig(kind="judge", judge={"model_path": "/j"}).missing() is None


def test_the_kinds_flags():
    """The answers the switches of cluster/ gave before they asked the registry."""
    flags = {
        k.name: (k.own_role, k.turn_rewards, k.accuracy, k.probability is not None, k.check is not None)
        for k in map(REWARD_KINDS.__getitem__, BUILT_IN)
    }
    assert flags == {
        "model": (None, False, False, True, False),
        "rule": (None, False, True, False, True),
        "remote": (None, False, False, False, False),
        "judge": ("judge", False, False, False, False),
        "environment": (None, True, True, False, False),
    }


def test_reward_to_prob_reads_a_classifiers_scores_only():
    s = np.array([0.0, 2.0, -1.0], dtype=np.float32)
    assert np.allclose(reward_to_prob(s, RewardConfig(score="logit_diff")), 1 / (1 + np.exp(-s)))
    assert reward_to_prob(s, RewardConfig(score="prob")) is s
    assert reward_to_prob(s, RewardConfig(score="logit")) is None
    for name in ("rule", "remote", "judge", "environment"):
        assert reward_to_prob(s, RewardConfig.model_construct(kind=name, score="logit_diff")) is None
