"""Config section owned by the learner role."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KLConfig(_Strict):
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="Per-token KL estimator in the shaped reward."
    )
    coef: float = Field(0.05, ge=0.0, description="Initial (or fixed) KL coefficient beta.")
    adaptive: bool = Field(False, description="Adapt beta towards `target` (Ziegler et al. 2019).")
    target: float = Field(6.0, gt=0.0, description="Target KL per sequence for the adaptive controller.")
    horizon: int = Field(10000, ge=1, description="Adaptive controller horizon in samples.")


class LearnerConfig(_Strict):
    num_ranks: int = Field(1, ge=1, description="Data-parallel learner ranks (one torch.distributed world).")
    num_cpus_per_rank: float = Field(0.5, gt=0.0, description="Ray CPUs per learner rank.")
    num_gpus_per_rank: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Ray GPUs per learner rank: exactly 1 with the nccl backend (each rank drives one GPU, device 0 "
            "of what Ray shows it), 0 with gloo (the rank trains on CPU); 'auto' picks the backend from it."
        ),
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per rank.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto = nccl with GPUs, else gloo."
    )
    zero_stage: Literal[2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Training precision (bfloat16 on GPU)."
    )
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate (policy and value head).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up in optimizer steps.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Global gradient-norm clip.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    num_minibatches: int = Field(
        1, ge=1, description="Optimizer steps per epoch (the rollout batch is split into this many)."
    )
    micro_batch_size: int = Field(
        16,
        ge=1,
        description="Sequences per forward/backward on one rank (gradient accumulation fills a minibatch).",
    )
    clip_eps: float = Field(
        0.2, gt=0.0, description="PPO ratio clip (lower side, and upper unless clip_eps_high)."
    )
    clip_eps_high: float | None = Field(
        None, gt=0.0, description="Upper ratio clip (asymmetric clipping); None = clip_eps."
    )
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual-clip constant c > 1 for negative advantages; None = off."
    )
    value_clip_eps: float = Field(0.2, gt=0.0, description="Value-function clip around the old values.")
    vf_coef: float = Field(0.1, ge=0.0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    whiten_advantages: bool = Field(
        True, description="Whiten advantages over the valid tokens of the whole batch (all ranks)."
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="Loss aggregation."
    )
    off_policy: Literal["auto", "none", "tis", "mask", "geo_mask"] = Field(
        "auto",
        description=(
            "Behaviour/proximal correction per token with rho = pi_prox/mu: 'tis' min(rho, cap), 'mask' "
            "1[rho <= cap], 'geo_mask' drops a sequence whose geometric-mean rho is outside "
            "off_policy_geo_bounds. 'auto' = 'tis' in async mode with max_staleness > 0 or when "
            "rollout.dtype differs from learner.dtype, else 'none'; "
            "'none' there is a config error."
        ),
    )
    off_policy_cap: float = Field(2.0, gt=0.0, description="Cap C of 'tis' and threshold of 'mask'.")
    off_policy_geo_bounds: tuple[float, float] = Field(
        (0.5, 2.0), description="[lo, hi] kept range of the per-sequence geometric-mean ratio ('geo_mask')."
    )
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty in the reward.")
    value_head_std: float = Field(0.0, ge=0.0, description="Init std of the value head weights (0 = zeros).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (large models)."
    )
    dist_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="torch.distributed timeout: rendezvous and any one collective (a rank waiting on a stuck peer fails after this).",
    )
    offload_optimizer: bool = Field(
        False,
        description=(
            "ZeRO-Offload: keep the fp32 master weights and Adam moments in CPU memory and run the Adam "
            "step there with DeepSpeed's DeepSpeedCPUAdam (a C++ op JIT-built on first use: needs g++ "
            "and ninja); frees GPU memory at the cost of host<->device traffic each step."
        ),
    )
    offload_params: bool = Field(
        False,
        description=(
            "ZeRO-Infinity parameter offload (zero_stage 3 only): keep parameter partitions in CPU memory "
            "and fetch each layer to the GPU when it runs."
        ),
    )
    export_bucket_mb: float = Field(
        256.0,
        gt=0.0,
        description=(
            "Most full-size parameter bytes gathered at once when exporting weights or writing a "
            "checkpoint (ZeRO-3 gathers one bucket at a time, so this bounds the extra memory on every rank)."
        ),
    )
    checkpoint_format: Literal["consolidated", "deepspeed"] = Field(
        "consolidated",
        description=(
            "'consolidated': rank 0 writes full fp32 weights, Adam moments and step as safetensors shards "
            "(loadable by any number of learner ranks and ZeRO stage); 'deepspeed': DeepSpeed's per-rank "
            "ZeRO files (resume needs the same num_ranks). Loading detects the format from the files."
        ),
    )
    deepspeed_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Deep-merged into the generated DeepSpeed config (e.g. offload, bucket sizes, stage3_param_persistence_threshold).",
    )

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        lo, hi = self.off_policy_geo_bounds
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"off_policy_geo_bounds must satisfy 0 < lo <= 1 <= hi (got {(lo, hi)})")
        if self.num_gpus_per_rank not in (0.0, 1.0):
            raise ValueError(
                f"learner.num_gpus_per_rank must be 0 (CPU, gloo) or 1 (one GPU per rank, nccl); got "
                f"{self.num_gpus_per_rank:g}: a rank drives exactly one device (use more ranks for more GPUs)"
            )
        if self.backend == "nccl" and self.num_gpus_per_rank != 1:
            raise ValueError(
                "learner.backend='nccl' needs learner.num_gpus_per_rank: 1 (allowed: 1 with nccl)"
            )
        if self.backend == "gloo" and self.num_gpus_per_rank != 0:
            raise ValueError(
                "learner.backend='gloo' trains on CPU: learner.num_gpus_per_rank must be 0 "
                "(or set backend: nccl / auto to train on the GPU)"
            )
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(
                f"learner.offload_params needs learner.zero_stage: 3 (got {self.zero_stage}); "
                "ZeRO-2 offloads only the optimizer (learner.offload_optimizer)"
            )
        return self
