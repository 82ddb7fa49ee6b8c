"""Config sections owned by the scoring role (reward model, rule rewards, reference policy)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RewardConfig(_Strict):
    kind: Literal["model", "rule", "remote", "environment"] = Field(
        "model",
        description="Reward source: a sequence-classification model, a registered rule function, a remote HTTP "
        "endpoint, or 'environment': the rewards of each multi-turn episode's environment (rollout.environment), "
        "all of them: the outcome (the last turn's reward) on the last model token and each earlier turn's reward "
        "on that turn's last token. With any other kind an episode's transcript is scored and that score is its "
        "whole reward: none of the environment's turn rewards is used.",
    )
    model_path: str | None = Field(
        None, description="Folder of the reward model (save_pretrained layout); kind='model'."
    )
    score: Literal["logit", "logit_diff", "prob"] = Field(
        "logit_diff",
        description="Scalar taken from the classifier: positive-class logit, logit(pos) - logit(neg), or P(pos).",
    )
    positive_label: int = Field(1, ge=0, description="Index of the class that counts as reward.")
    rule: str | None = Field(None, description="Name of a registered rule reward function; kind='rule'.")
    rule_module: str | None = Field(
        None,
        description="Module (dotted name or .py file) imported before the rule lookup, so it can register its own rules.",
    )
    url: str | None = Field(None, description="Remote reward endpoint; kind='remote'.")
    token_env: str = Field(
        "REWARD_API_TOKEN", description="Environment variable holding the remote endpoint's bearer token."
    )
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one remote reward request.")
    max_retries: int = Field(2, ge=0, description="Bounded retries of a failed remote request.")
    retry_backoff_s: float = Field(
        0.5, ge=0, description="First delay before a remote retry; doubles on each further retry."
    )
    max_failure_frac: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Abort the run when more than this fraction of a step's rewards fail.",
    )
    num_replicas: int = Field(1, ge=1, description="Reward scorer actors.")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs per reward actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per reward actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each reward actor needs besides CPUs/GPUs, to pin it to node types: {'reward_node': 1} runs it only on nodes started with `ray start --resources` naming reward_node; {'node:<ip>': 0.01} pins it to one node. Empty: any node.",
    )
    batch_size: int = Field(
        64, ge=1, description="Samples per reward-model forward (and per remote request)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Reward model weights dtype; scores are computed in float32."
    )


class ReferenceConfig(_Strict):
    model_path: str | None = Field(
        None, description="Frozen reference policy; defaults to the initial policy."
    )
    num_replicas: int = Field(1, ge=1, description="Reference policy actors.")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs per reference actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per reference actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each reference actor needs besides CPUs/GPUs, to pin it to node types: {'reward_node': 1} runs it only on nodes started with `ray start --resources` naming reward_node; {'node:<ip>': 0.01} pins it to one node. Empty: any node.",
    )
    batch_size: int = Field(64, ge=1, description="Sequences per reference forward.")
    pack_sequences: bool | None = Field(
        None,
        description=(
            "Score each batch as one padding-free row (see learner.pack_sequences, checked the same way at "
            "start-up); None follows learner.pack_sequences."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Reference weights dtype."
    )
