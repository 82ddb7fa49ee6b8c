"""The fields of the learner's section, each with its default, its bounds and its description, and the
checks of one field alone; `learner.config.LearnerConfig` adds the cross-field rules
(learner/config_rules.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from kernel.strict import Strict as _Strict
from learner.config_blocks import ClipConfig, KLConfig, LoRAConfig, OverlongConfig
from learner.registry import ADVANTAGES, LOSS_AGGS, OFF_POLICY, POLICY_LOSSES

# The allowed values of the registered algorithm parts (learner.registry): the one list of each.
AdvantageName = Literal[ADVANTAGES.names()]
PolicyLossName = Literal[POLICY_LOSSES.names()]
LossAggName = Literal[LOSS_AGGS.names()]
OffPolicyName = Literal[OFF_POLICY.names()]  # a correction the learner applies ('auto' decided)
OffPolicySetting = Literal[("auto", *OFF_POLICY.names())]  # what the config may say: 'auto' or a correction


class LearnerFields(_Strict):
    """The learner's section, field by field (`LearnerConfig` is it with its cross-field rules)."""

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
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each learner rank needs besides CPUs/GPUs, to pin it to node types: {'learner_node': 1} runs it only on nodes started with `ray start --resources` naming learner_node; {'node:<ip>': 0.01} pins it to one node. Empty: any node.",
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per rank.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto = nccl with GPUs, else gloo."
    )
    zero_stage: Literal[2, 3] = Field(2, description="DeepSpeed ZeRO stage.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Training precision (bfloat16 on GPU)."
    )
    lr: float = Field(
        1e-4, gt=0.0, description="AdamW learning rate (policy, and value head unless value_lr)."
    )
    value_lr: float | None = Field(
        None,
        gt=0.0,
        description=(
            "AdamW learning rate of the value head alone (None = lr). Adam moves a weight by about its lr "
            "per step, so with rewards of order 1-10 the critic needs a larger rate than the policy to keep up."
        ),
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    fused_adam: bool = Field(
        False,
        description=(
            "torch's fused AdamW kernel (CPU and GPU): the update in place, without the temporaries of the "
            "parameters' size the default implementation makes (on CPU two, each as large as a rank's "
            "partition: 1.8 GiB per rank at 0.5B under ZeRO-3). Rounds differently in the last bits, so off "
            "by default: the demos' measured runs keep their numbers. Not with learner.offload_optimizer "
            "(DeepSpeed's CPU Adam steps then)."
        ),
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description=(
            "Linear LR warm-up in optimizer steps: step k < warmup_steps trains at lr x (k + 1) / warmup_steps "
            "(every lr_schedule). With 'linear' or 'cosine' it must be less than lr_schedule_steps."
        ),
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description=(
            "LR after the warm-up, over the run's optimizer steps: 'constant' lr; 'linear' / 'cosine' decay "
            "from lr at the end of the warm-up to min_lr_ratio x lr at lr_schedule_steps (transformers' "
            "warmup-stable-decay lambdas, no stable phase), then stay there. Scales value_lr by the same "
            "factor; a resumed run goes on from its checkpoint's step. Logged as train/lr (docs/algorithms.md)."
        ),
    )
    min_lr_ratio: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description=(
            "Floor of the 'linear' / 'cosine' decay as a fraction of lr (unused with 'constant'). Default 0.1, "
            "OpenRLHF's cosine_with_min_lr floor: the late updates, when most samples are right and the "
            "advantages mostly noise, are 10x smaller, yet the end of the run still learns (0 spends the last "
            "steps at a rate near zero)."
        ),
    )
    lr_schedule_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "Length of the LR schedule in optimizer steps (warm-up included). None: run.steps x ppo_epochs x "
            "num_minibatches, filled in by the cluster (every PPO step counts ppo_epochs x num_minibatches "
            "steps, taken, skipped or empty alike); set it to decay over a longer or shorter span. A learner "
            "used alone needs it with 'linear' or 'cosine'."
        ),
    )
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
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description=(
            "Token budget of one forward/backward on one rank (prompt + response tokens; a padded micro-batch "
            "counts rows x its longest row, a packed one the sum). Set: micro-batches are cut by tokens "
            "(first-fit decreasing) for the proximal pass and every PPO epoch, and micro_batch_size is not "
            "used; the loss is normalised by the minibatch's global counts, so the gradient does not depend "
            "on the cut. A sequence longer than the budget is an error. None: micro_batch_size rows."
        ),
    )
    pack_sequences: bool = Field(
        False,
        description=(
            "Padding-free micro-batches: the rows are laid end to end in one row with position ids restarting "
            "at each sequence and no attention across sequences (transformers' packed-sequence masking: SDPA "
            "or eager on CPU, flash-attention varlen on GPU). Checked once at start-up on the model itself: "
            "an architecture whose packed logits differ from the padded ones is refused."
        ),
    )
    router_replay: Literal["none", "R2", "R3"] = Field(
        "none",
        description=(
            "Rollout routing replay for a mixture-of-experts policy (docs/moe.md; R3, arXiv 2510.11370). "
            "'R3': every forward of the policy on a batch (the proximal pass, the reference_from_base pass, "
            "the PPO passes) routes each token to the experts the engine chose for it (rollout.record_routing), "
            "with the gate values recomputed from the live router logits so the router still learns; padding "
            "and each sequence's last token keep the learner's own routing. 'R2': the PPO passes route as the "
            "learner's own proximal pass did (recorded there, no engine recording needed). 'none': the learner "
            "routes itself."
        ),
    )
    logits_chunk_tokens: int | Literal["auto"] | None = Field(
        "auto",
        description=(
            "Score response tokens from the final hidden states this many positions at a time, the lm_head "
            "and log-softmax recomputed in backward, so no [tokens, vocabulary] float32 logits, log-softmax or "
            "gradient exist whole (equal to the full path up to float rounding order). Only for models whose "
            "logits are exactly lm_head(hidden) (gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe with no softcap or logit "
            "scale); an int on any other model is an error. 'auto': 512 where the model qualifies, else the "
            "model's own full logits path; null: always the full logits path."
        ),
    )
    balance_ranks: Literal["count", "tokens"] = Field(
        "tokens",
        description=(
            "How a batch is split over learner ranks (whole groups always stay on one rank): 'tokens' "
            "balances prompt + response tokens (largest group first onto the least-loaded rank, or the even "
            "split where that is better), 'count' an even split of sequences in batch order."
        ),
    )
    clip: ClipConfig = Field(
        default_factory=ClipConfig,
        description="The policy loss's ratio clip [1 - eps, 1 + eps_high] and dual clip, read by every policy_loss.",
    )
    value_clip_eps: float = Field(0.2, gt=0.0, description="Value-function clip around the old values.")
    value_clip: Literal["absolute", "relative", "off"] = Field(
        "absolute",
        description=(
            "How far one PPO iteration may move the value from the old value: 'absolute' value_clip_eps; "
            "'relative' value_clip_eps x the std of the batch's returns (all ranks), so the clip follows "
            "the reward scale; 'off' no clip (plain squared error)."
        ),
    )
    reward_norm: Literal["off", "scale", "standardize"] = Field(
        "off",
        description=(
            "Normalise each sample's return (its score plus a multi-turn episode's earlier-turn rewards) with "
            "the returns' running mean/std over all ranks and steps (saved in checkpoints) before the KL penalty "
            "is added: every reward (score and turn rewards) is divided by the std, and 'standardize' also takes "
            "the mean off once, from the score: 'scale' return/std (keeps the reward's zero), 'standardize' "
            "(return - mean)/std, 'off' raw rewards."
        ),
    )
    reward_norm_clip: float | None = Field(
        None,
        gt=0.0,
        description=(
            "Clip normalised returns to [-c, c], the score (on the last token) taking the difference (None = no "
            "clip; unused when reward_norm is off)."
        ),
    )
    vf_coef: float = Field(0.1, ge=0.0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor.")
    whiten_advantages: bool = Field(
        True,
        description=(
            "Whiten gae/vtrace advantages over the valid tokens of the whole batch (all ranks); grpo and "
            "rloo keep their group baseline, reinforce_pp always whitens its returns. Whitening centres them: "
            "while the critic lags a rising success rate, that gives many tokens of right responses a negative "
            "advantage (docs/demos.md, the calculator demo)."
        ),
    )
    advantage: AdvantageName = Field(
        "gae",
        description=(
            f"Advantage estimator: {ADVANTAGES.describe()}. Only "
            f"{' and '.join(e.name for e in ADVANTAGES if e.critic)} train a critic; "
            f"{' and '.join(e.name for e in ADVANTAGES if e.groups)} need rollout.sampling.n >= 2. An "
            "estimator's own parameters are the block named after it (learner."
            + ", learner.".join(e.name for e in ADVANTAGES if e.section)
            + "), read only when it is selected."
        ),
    )
    policy_loss: PolicyLossName = Field(
        "ppo",
        description=(
            f"Policy loss: {POLICY_LOSSES.describe()}. A loss defined with one aggregation "
            "("
            + ", ".join(f"{p.name}: {p.loss_agg}" for p in POLICY_LOSSES if p.loss_agg)
            + ") needs that loss_agg."
        ),
    )
    missing_eos_penalty: float | None = Field(
        None,
        ge=0.0,
        description=(
            "Subtracted from the score of a response cut at max_new_tokens (no EOS); None = off. Adds to "
            "the overlong penalty (score - missing_eos_penalty * truncated + overlong penalty, overlong.buffer), "
            "before reward_norm."
        ),
    )
    overlong: OverlongConfig = Field(
        default_factory=OverlongConfig,
        description="DAPO's overlong reward shaping and overlong filtering (Yu et al. 2025), off by default.",
    )
    truncation: Literal["terminal", "bootstrap"] = Field(
        "terminal",
        description=(
            "A response cut at max_new_tokens: 'terminal' (value 0 after its last token) or 'bootstrap' "
            "(the critic's value of the state after its last token; gae/vtrace only, and single responses only: "
            "with rollout.environment that state is followed by observation tokens, never a value target, so "
            "the run config refuses it)."
        ),
    )
    loss_agg: LossAggName = Field(
        "token-mean", description=f"How every per-token loss term becomes a scalar: {LOSS_AGGS.describe()}."
    )
    loss_norm_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "The constant L of loss_agg 'seq-mean-token-sum-norm' (Dr. GRPO's generation budget); None: "
            "rollout.sampling.max_new_tokens, or rollout.environment.max_total_tokens with an environment "
            "(a learner used alone needs it set). Unused by the other aggregations."
        ),
    )
    off_policy: OffPolicySetting = Field(
        "auto",
        description=(
            f"Behaviour/proximal (rollout) correction with rho = pi_prox/mu, a preset: {OFF_POLICY.describe()}. "
            "'auto' = 'tis' in async mode with max_staleness > 0 or when rollout.dtype differs from "
            "learner.dtype, else 'none'; 'none' there is a config error. A preset's parameters are its block ("
            + ", ".join(
                f"learner.{p.block_field}" + ("" if p.block_field == p.name else f" for {p.name}")
                for p in OFF_POLICY
                if p.section
            )
            + "), read only when off_policy names it (not with 'auto'), required where the preset says so ("
            + ", ".join(p.name for p in OFF_POLICY if p.section_required)
            + "). See docs/algorithms.md."
        ),
    )
    proximal_pass: Literal["auto", "always", "bypass"] = Field(
        "auto",
        description=(
            "The no-grad forward that recomputes the old logprobs before the PPO epochs. 'auto': skipped where "
            "the engine's behaviour logprobs provably are the learner's (sync pipeline, every engine "
            "acknowledged the learner's current weights by digest, rollout.dtype equal to learner.dtype, no "
            "environment, an estimator with no critic, no off-policy correction, no reference_from_base): they "
            "are the old logprobs then, and the gap is still measured every proximal_check_every steps "
            "(learner/bypass.py). 'always': the forward runs on every step. 'bypass': never (verl's bypass "
            "mode): the behaviour logprobs are the old ones, so the PPO ratio is pi_theta/mu and its clip is "
            "the only correction; refused with a critic, reference_from_base or an explicit off_policy."
        ),
    )
    proximal_check_every: int = Field(
        10,
        ge=1,
        description="With proximal_pass 'auto': the first step and one in this many run the proximal pass "
        "anyway and measure the engine-learner logprob gap (rollout/logprob_gap); a gap over 1e-4 nats per "
        "token ends the bypass for the run.",
    )
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty in the reward.")
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig, description="LoRA adapters on the policy (rank 0 = off)."
    )
    reference_from_base: bool = Field(
        False,
        description=(
            "The reference logprobs are computed here, from the policy's base weights with the LoRA adapters off "
            "(one more no-grad forward per micro-batch), instead of arriving with the trajectories: no second "
            "copy of the model. Needs lora.rank > 0. Set by the cluster from reference.source."
        ),
    )
    export_adapter: bool = Field(
        False,
        description=(
            "Weight exports for the engines hold the LoRA adapter alone (learner.lora.adapter_bundle: megabytes, "
            "not the model) instead of the merged weights. Needs lora.rank > 0. Set by the cluster from "
            "rollout.lora_sync."
        ),
    )
    value_head_std: float = Field(0.0, ge=0.0, description="Init std of the value head weights (0 = zeros).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (large models)."
    )
    attn_implementation: str | None = Field(
        None,
        description=(
            "transformers' attention implementation for the policy ('sdpa', 'eager', 'flash_attention_2', ...); "
            "None: transformers' default. On GPUs with pack_sequences use 'flash_attention_2' (varlen "
            "kernels: cost per sequence, not per packed row); the packing check at start-up covers it too."
        ),
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

    @field_validator("logits_chunk_tokens")
    @classmethod
    def _positive_chunk(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"logits_chunk_tokens must be >= 1, 'auto' or null (got {v})")
        return v

    @field_validator("value_clip", "reward_norm", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        """YAML reads a bare `off` as False: take it as the 'off' it was written as."""
        return "off" if value is False else value
