"""What a run derives from the user's config, in a record of its own: the config keeps what the user wrote
('auto' stays 'auto', an unset field stays null, also in the run folder's config.yaml), and
`resolve(cfg)` (`RunConfig.resolved`) computes the values the run uses in their place, with the sections
the roles are started with.

The run config's validator checks its combinations against these same values (cluster.config.schema).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from cluster.config.sections import PipelineSection, RunSection
from learner.config import LearnerConfig
from learner.config_fields import OffPolicyName
from learner.registry import ADVANTAGES, LOSS_AGGS
from reward_service.config import ReferenceConfig
from rollout_workers.config import RolloutConfig


class RunConfig(Protocol):
    """The sections of `cluster.config.schema.RunConfig` the derived values come from."""

    run: RunSection
    rollout: RolloutConfig
    reference: ReferenceConfig
    learner: LearnerConfig
    pipeline: PipelineSection

    @property
    def episodes(self) -> bool: ...  # samples are multi-turn episodes (an environment's or agent sessions)

    @property
    def longest_episode(self) -> int: ...  # the most tokens an episode holds, prompt included


@dataclass(frozen=True)
class Resolved:
    """The derived values of one run config, and the role sections built from them."""

    off_policy: OffPolicyName  # learner.off_policy, 'auto' decided: a registered correction
    overlong_max_tokens: int  # learner.overlong.max_tokens: rollout.sampling.max_new_tokens
    loss_norm_tokens: int | None  # learner.loss_norm_tokens, filled in for a horizon loss_agg
    lr_schedule_steps: int  # learner.lr_schedule_steps, unset: the run's optimizer steps
    reference_source: Literal["actors", "policy_base"]  # reference.source, 'auto' decided
    reference_pack_sequences: bool  # reference.pack_sequences, unset: learner.pack_sequences
    learner: (
        LearnerConfig  # the learner ranks' section: the values above, reference_from_base, export_adapter
    )
    reference: ReferenceConfig  # the reference actors' section: source and pack_sequences filled in

    @property
    def reference_from_base(self) -> bool:
        """The learner computes the reference logprobs itself (learner.reference_from_base)."""
        return self.learner.reference_from_base

    @property
    def export_adapter(self) -> bool:
        """Weight exports hold the LoRA adapter alone (learner.export_adapter, from rollout.lora_sync)."""
        return self.learner.export_adapter


def stale(cfg: RunConfig) -> bool:
    """The pipeline trains on samples of older policies (async with max_staleness > 0)."""
    return cfg.pipeline.mode == "async" and cfg.pipeline.max_staleness > 0


def off_policy(cfg: RunConfig) -> str:
    """learner.off_policy with 'auto' decided: 'none' where the estimator corrects for the behaviour policy
    itself (vtrace's truncated importance weights are the correction); else 'tis' whenever behaviour and
    proximal logprobs can differ (stale samples, or a generator whose numerics differ from the learner's,
    e.g. a bf16 engine), 'none' otherwise."""
    le = cfg.learner
    if le.off_policy != "auto":
        return le.off_policy
    if ADVANTAGES[le.advantage].corrects_off_policy:
        return "none"
    return "tis" if stale(cfg) or cfg.rollout.dtype != le.dtype else "none"


def loss_norm_tokens(cfg: RunConfig) -> int | None:
    """Dr. GRPO's constant (learner.loss_norm_tokens) is the most response tokens a sample can have."""
    le = cfg.learner
    if LOSS_AGGS[le.loss_agg].horizon and le.loss_norm_tokens is None:
        return cfg.longest_episode if cfg.episodes else cfg.rollout.sampling.max_new_tokens
    return le.loss_norm_tokens


def optimizer_steps(cfg: RunConfig) -> int:
    """The run's optimizer steps, the slots the LR schedule's clock counts: run.steps x ppo_epochs x
    num_minibatches."""
    return cfg.run.steps * cfg.learner.ppo_epochs * cfg.learner.num_minibatches


def reference_source(cfg: RunConfig) -> str:
    """reference.source with 'auto' decided: the policy's base weights in a LoRA run with no reference
    model of its own, else reference actors."""
    ref = cfg.reference
    if ref.source != "auto":
        return ref.source
    return "policy_base" if cfg.learner.lora.rank > 0 and ref.model_path is None else "actors"


def resolve(cfg: RunConfig) -> Resolved:
    """The derived values of `cfg` (a validated run config), computed from it; `cfg` is left as it is."""
    le, ref = cfg.learner, cfg.reference
    source = reference_source(cfg)
    pack = le.pack_sequences if ref.pack_sequences is None else ref.pack_sequences
    overlong_max_tokens = cfg.rollout.sampling.max_new_tokens
    derived = {
        "off_policy": off_policy(cfg),
        "loss_norm_tokens": loss_norm_tokens(cfg),
        "lr_schedule_steps": le.lr_schedule_steps
        if le.lr_schedule_steps is not None
        else optimizer_steps(cfg),
    }
    learner = le.model_copy(
        update={
            **derived,
            "overlong": le.overlong.model_copy(update={"max_tokens": overlong_max_tokens}),
            "reference_from_base": source == "policy_base",
            "export_adapter": cfg.rollout.lora_sync == "adapter",
        }
    )
    reference = ref.model_copy(update={"source": source, "pack_sequences": pack})
    return Resolved(
        **derived,
        overlong_max_tokens=overlong_max_tokens,
        reference_source=source,
        reference_pack_sequences=pack,
        learner=learner,
        reference=reference,
    )
