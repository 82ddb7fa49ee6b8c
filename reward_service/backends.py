"""The reward kinds (`reward.kind`) by name, each registered once with what the rest of the code asks
about it.

Each kind is one `RewardKind`: its backend class (`function`, "module:Class", imported on first use so
this module, and the config with it, loads without torch), the config fields it needs, and the flags the
config, the roles and the reports read instead of comparing kind names: the config's allowed values
(`RewardConfig.kind`'s `Literal` is built from `names()`) and its rules (`needs`, `own_role`,
`turn_rewards`), its config section (`section`: the model of `reward.<kind>`, a field `RewardConfig` is
built with), which role scores (`own_role`: a role of `cluster.roles.registry`, which builds the standard
reward role for a kind it does not describe itself), the driver's check before any actor starts
(`check`), which held-out metrics exist (`accuracy`) and how a score reads as a probability
(`probability`, `reward_to_prob`).

A backend is a class `(config: RewardConfig, model=None)` (`model`: what serves it when the cluster
builds that, the judge's engine; None: its own default) with `score(samples, out)`: it scores
`samples.live` (a `reward_service.samples.Samples`) into `out` (a `ScoreBatch`), each sample's value
set or failed with its error. `RewardScorer` holds exactly one, chosen here. Adding a kind is one
entry here, its backend module and its test; or a module of its own holding its `RewardKind` (and its
section's model), listed below by its `"module:KIND"`: one line. Such a module is imported when the
config is read, so it imports no torch (its backend is named by string).

This module imports nothing of the project but the registry type and the strict base model, so the
config (and every role) may import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from pydantic import Field

from kernel.registry import Part, Registry, resolve
from kernel.strict import Strict


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardKind(Part):
    # function: the backend class, "module:Class"
    needs: tuple[str, ...] = ()  # fields under reward. of which one must be set ("judge.model_path")
    # the role that scores it (a role of `cluster.roles.registry`; one it does not describe is the standard
    # reward role, its counts in this kind's section), and then no reward scorer runs; None: the scorers do
    own_role: str | None = None
    # section (`Part.section`): the model of the field `reward.<name>`; a kind with `own_role` needs one with
    # `RoleSection`'s fields
    turn_rewards: bool = False  # scores each episode by ALL its environment's rewards (needs an environment)
    accuracy: bool = False  # a score >= eval.correct_at is a right answer: eval/accuracy, pass@k, mean@n
    probability: str | None = None  # "module:function" (scores, reward config) -> P(positive) or None
    check: str | None = None  # "module:function" (reward config) run by the driver before actors start


REWARD_KINDS: Registry[RewardKind] = Registry(
    "reward kind",
    "reward.kind",
    [
        RewardKind(
            name="model",
            function="reward_service.kind_model:ModelBackend",
            summary="a sequence-classification model (reward.model_path) scores prompt + response",
            needs=("model_path",),
            probability="reward_service.backends:classifier_probability",
        ),
        RewardKind(
            name="rule",
            function="reward_service.kind_rule:RuleBackend",
            summary="reward functions (reward.rule or reward.functions), their weighted sum",
            needs=("rule", "functions"),
            accuracy=True,
            check="reward_service.weighted:load_functions",
        ),
        RewardKind(
            name="remote",
            function="reward_service.kind_remote:RemoteBackend",
            summary="a remote HTTP endpoint (reward.url)",
            needs=("url",),
        ),
        RewardKind(
            name="judge",
            function="reward_service.kind_judge:JudgeBackend",
            summary="a causal LM prompted with each sample (reward.judge), a role of its own",
            needs=("judge.model_path",),
            own_role="judge",
            section="reward_service.config:JudgeConfig",
        ),
        RewardKind(
            name="environment",
            function="reward_service.kind_environment:EnvironmentBackend",
            summary="the rewards of each multi-turn episode's environment (rollout.environment), all of them: "
            "the outcome (the last turn's reward) on the last model token and each earlier turn's reward on "
            "that turn's last token",
            turn_rewards=True,
            accuracy=True,
        ),
    ],
)


class RoleSection(Strict):
    """A reward kind's section when a role of its own scores it (`own_role`): its actors and what each
    holds. A kind's section model may subclass it."""

    num_replicas: int = Field(
        1, ge=1, description="Actors of the kind's own role (scaled with `cluster.scale <role>=K`)."
    )
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs per actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each actor needs besides CPUs/GPUs (as reward.resources). Empty: "
        "any node.",
    )


def section_fields(kind: RewardKind) -> tuple[type, str] | None:
    """The model of `kind`'s section (`reward.<name>`) and that field's description (the model's
    docstring); None without one. A kind scored by a role of its own without the role's counts
    (`RoleSection`'s fields) is a ValueError naming it."""
    if kind.section is None:
        if kind.own_role is not None:
            raise ValueError(f"reward kind {kind.name!r}: own_role needs a section (reward.{kind.name})")
        return None
    model = resolve(kind.section)
    missing = [f for f in RoleSection.model_fields if f not in model.model_fields]
    if kind.own_role is not None and missing:
        raise ValueError(
            f"reward kind {kind.name!r}: its role's section {kind.section} lacks {', '.join(missing)} "
            "(subclass reward_service.backends.RoleSection)"
        )
    return model, " ".join((model.__doc__ or "").split())


def reward_to_prob(scores: np.ndarray, reward: Any) -> np.ndarray | None:
    """P(positive) per score where the kind's scores (with `reward`, the reward config) read as one, so a
    report reads in the reward's own units; None where they do not."""
    convert = REWARD_KINDS[reward.kind].probability
    return None if convert is None else resolve(convert)(scores, reward)


def classifier_probability(scores: np.ndarray, reward: Any) -> np.ndarray | None:
    """A classifier's score as P(positive): the sigmoid of logit(pos) - logit(neg), P(pos) itself; a
    single logit is none."""
    if reward.score == "logit_diff":
        return 1.0 / (1.0 + np.exp(-scores))
    if reward.score == "prob":
        return scores
    return None
