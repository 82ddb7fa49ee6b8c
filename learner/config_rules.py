"""The cross-field rules of the learner's section: combinations of `learner.*` fields that cannot train
together, each refused with the fields to change. The rules that need other sections of a run (the
rollout's lengths, the pipeline's staleness) are the run config's (cluster.config.schema)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from learner.config_blocks import check_part_blocks
from learner.registry import ADVANTAGES, POLICY_LOSSES

if TYPE_CHECKING:
    from learner.config_fields import LearnerFields


def check_learner(cfg: LearnerFields) -> None:
    """Raise ValueError naming the fields of the first combination of `cfg` that cannot train."""
    check_part_blocks(cfg)
    _check_bypass(cfg)
    estimator = ADVANTAGES[cfg.advantage]
    if cfg.truncation == "bootstrap" and not estimator.critic:
        critics = " or ".join(repr(e.name) for e in ADVANTAGES if e.critic)
        raise ValueError(
            f"truncation='bootstrap' needs a critic: advantage must be {critics} (got {cfg.advantage!r})"
        )
    if estimator.corrects_off_policy and cfg.off_policy not in ("auto", "none"):
        raise ValueError(
            f"advantage={cfg.advantage!r} corrects for the behaviour policy inside its targets; off_policy="
            f"{cfg.off_policy!r} would correct twice: use 'auto' or 'none'"
        )
    if cfg.clip.dual is not None and not POLICY_LOSSES[cfg.policy_loss].dual_clip:
        takes = [p.name for p in POLICY_LOSSES if p.dual_clip]
        raise ValueError(
            f"learner.clip.dual applies to policy_loss {takes}; policy_loss={cfg.policy_loss!r} has no clipped "
            "branch to cap: leave clip.dual unset"
        )
    wanted = POLICY_LOSSES[cfg.policy_loss].loss_agg
    if wanted is not None and cfg.loss_agg != wanted:
        raise ValueError(
            f"learner.policy_loss={cfg.policy_loss!r} is defined with learner.loss_agg={wanted!r} (one term "
            f"per sequence); got loss_agg={cfg.loss_agg!r}: set learner.loss_agg: {wanted}"
        )
    if cfg.num_gpus_per_rank not in (0.0, 1.0):
        raise ValueError(
            f"learner.num_gpus_per_rank must be 0 (CPU, gloo) or 1 (one GPU per rank, nccl); got "
            f"{cfg.num_gpus_per_rank:g}: a rank drives exactly one device (use more ranks for more GPUs)"
        )
    if cfg.backend == "nccl" and cfg.num_gpus_per_rank != 1:
        raise ValueError("learner.backend='nccl' needs learner.num_gpus_per_rank: 1 (allowed: 1 with nccl)")
    if cfg.backend == "gloo" and cfg.num_gpus_per_rank != 0:
        raise ValueError(
            "learner.backend='gloo' trains on CPU: learner.num_gpus_per_rank must be 0 "
            "(or set backend: nccl / auto to train on the GPU)"
        )
    steps = cfg.lr_schedule_steps
    if cfg.lr_schedule != "constant" and steps is not None and cfg.warmup_steps >= steps:
        raise ValueError(
            f"learner.warmup_steps={cfg.warmup_steps} must be less than learner.lr_schedule_steps={steps}: "
            f"learner.lr_schedule={cfg.lr_schedule!r} decays after the warm-up (a shorter warm-up, or "
            "lr_schedule: constant)"
        )
    if cfg.reference_from_base and cfg.lora.rank == 0:
        raise ValueError(
            "learner.reference_from_base needs learner.lora.rank > 0: without adapters the learner's weights "
            "are the trained policy, not the frozen reference"
        )
    if cfg.export_adapter and cfg.lora.rank == 0:
        raise ValueError(
            "learner.export_adapter needs learner.lora.rank > 0: without adapters there is no adapter to "
            "export (rollout.lora_sync='merged')"
        )
    if cfg.fused_adam and cfg.offload_optimizer:
        raise ValueError(
            "learner.fused_adam and learner.offload_optimizer: an offloaded optimizer is DeepSpeed's "
            "DeepSpeedCPUAdam, not torch's AdamW; set one of them"
        )
    if cfg.offload_params and cfg.zero_stage != 3:
        raise ValueError(
            f"learner.offload_params needs learner.zero_stage: 3 (got {cfg.zero_stage}); "
            "ZeRO-2 offloads only the optimizer (learner.offload_optimizer)"
        )


def _check_bypass(cfg: LearnerFields) -> None:
    """The explicit bypass mode takes no forward that a critic, a base-weight reference or a correction
    needs."""
    if cfg.proximal_pass == "bypass":
        if ADVANTAGES[cfg.advantage].critic:
            raise ValueError(
                f"learner.proximal_pass='bypass' skips the forward that computes values: advantage="
                f"{cfg.advantage!r} learns a critic (use proximal_pass 'auto' or 'always')"
            )
        if cfg.reference_from_base:
            raise ValueError(
                "learner.proximal_pass='bypass' skips the forward that learner.reference_from_base needs "
                "(use proximal_pass 'auto' or 'always')"
            )
        if cfg.off_policy not in ("auto", "none"):
            raise ValueError(
                f"learner.proximal_pass='bypass' makes pi_prox = mu, so rho = 1 and learner.off_policy="
                f"{cfg.off_policy!r} would do nothing: use off_policy 'auto' or 'none' (the PPO clip on "
                "pi_theta/mu is the correction there)"
            )
