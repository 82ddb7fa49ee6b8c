"""What one learner rank writes to disk and reads back: its resumable checkpoint and its final model.

The rule: everything a rank carries across a restart beside the engine's weights and optimizer (the
KL controller, the running reward moments, every rank's torch/shuffle/CUDA RNG, the caller's client
state) travels in one record kept once (rank 0's), and everything loads weights-only: RNG states are
uint8 tensors, a client state that would not load so fails at save time, a file holding anything else
raises `UnsafeCheckpointError` at load time. All ranks call each function (ZeRO gathers inside).

Formats (`learner.checkpoint_format`): 'consolidated' (`learner.consolidated_checkpoint`) loads into
any number of ranks; 'deepspeed' is DeepSpeed's per-rank ZeRO files and needs the same world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from learner.algorithms import AdaptiveKLController, FixedKLController
from learner.config import LearnerConfig
from learner.critic import RunningMoments
from learner.gather import cpu_state_dict
from learner.lora import adapter_state, has_lora, merged_cpu_state_dict, save_adapter

STATE_KEY = "_learner_rank"
ADAPTER_DIR = "adapter"  # final/adapter/: a LoRA run's adapter in PEFT's format, beside the merged model


class Carried(NamedTuple):
    """What a rank carries across a checkpoint beside its engine (restored in place on load)."""

    kl_controller: AdaptiveKLController | FixedKLController
    reward_moments: RunningMoments
    generator: torch.Generator  # the shuffle RNG


class Where(NamedTuple):
    """This rank in its world, and the gather's bucket (`learner.export_bucket_mb`) in bytes."""

    rank: int
    world_size: int
    bucket_bytes: int


def save_model(
    engine, path: str, tokenizer_from: str, model_path: str, config: LearnerConfig, at: Where
) -> None:
    """Rank 0 writes the HF policy, value head and tokenizer files (copied from `tokenizer_from`) to
    `path`; the full weights are gathered bucket by bucket. A LoRA policy is written merged, and its
    adapter alone goes to `path/adapter/` in PEFT's format (`learner.lora.save_adapter`)."""
    keep = at.rank == 0
    policy = merged_cpu_state_dict(engine.module.policy, at.bucket_bytes, keep)
    head = cpu_state_dict(engine.module.value_head.state_dict(keep_vars=True), at.bucket_bytes, keep)
    lora = has_lora(engine.module.policy)
    adapter = adapter_state(engine.module.policy, at.bucket_bytes, keep) if lora else None
    if keep:
        engine.module.save_pretrained(
            path, tokenizer_from=tokenizer_from, policy_state=policy, head_state=head
        )
        if lora:
            save_adapter(Path(path) / ADAPTER_DIR, config.lora, adapter, model_path)
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    engine, path: str, client_state: dict, carried: Carried, checkpoint_format: str, at: Where
) -> None:
    """Weights, optimizer, LR schedule, `carried` and every rank's RNG into the folder `path`, in
    `checkpoint_format`; `client_state` is checked here so a bad one fails now rather than on resume."""
    from learner.safe_checkpoint import check_weights_only_loadable

    check_weights_only_loadable(client_state, "learner client_state")
    rng = {"torch": torch.get_rng_state(), "shuffle": carried.generator.get_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    # One client state is kept (rank 0's), so every rank's RNG travels in it.
    rngs: list = [None] * at.world_size
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    mine = {
        "client": dict(client_state),
        "kl_controller": carried.kl_controller.state_dict(),
        "reward_moments": carried.reward_moments.state_dict(),
        "rng": rngs,
    }
    if checkpoint_format == "consolidated":
        from learner import consolidated_checkpoint

        consolidated_checkpoint.save(engine, path, at.rank, at.bucket_bytes, mine)
    else:
        engine.save_checkpoint(str(path), client_state={STATE_KEY: mine})


def load_checkpoint(engine, path: str, carried: Carried, at: Where) -> dict:
    """Restore what `save_checkpoint` wrote (either format, told apart by its files) into `engine` and
    `carried`; returns the caller's `client_state`.

    A consolidated checkpoint loads into any world size; rank r takes saved rank r's RNG (saved rank
    r mod the old world size when the world grew: data order across a rank-count change is not
    reproducible anyway, the shards differ). DeepSpeed's per-rank files need the same world size.
    Every file is read weights-only (safetensors, or torch.load(weights_only=True)): a file holding
    anything but tensors, plain containers and DeepSpeed's allow-listed state classes raises
    UnsafeCheckpointError.
    """
    from learner import consolidated_checkpoint
    from learner.safe_checkpoint import load_checkpoint_safely

    if consolidated_checkpoint.is_consolidated(path):
        mine = consolidated_checkpoint.load(engine, path)
    else:
        load_path, state = load_checkpoint_safely(engine, path)
        if load_path is None:
            raise FileNotFoundError(
                f"no learner checkpoint under {path!r} (no {consolidated_checkpoint.INDEX}, "
                "and no DeepSpeed 'latest' or tag folder)"
            )
        mine = (state or {}).get(STATE_KEY)
        if mine is None:
            raise KeyError(f"checkpoint {load_path!r} has no learner-rank state ({STATE_KEY!r})")
        if len(mine["rng"]) != at.world_size:
            raise ValueError(
                f"DeepSpeed checkpoint of {len(mine['rng'])} ranks; this world has {at.world_size} "
                "(write checkpoints with learner.checkpoint_format: consolidated to change num_ranks)"
            )
    carried.kl_controller.load_state_dict(mine["kl_controller"])
    if "reward_moments" in mine:  # absent in checkpoints written before reward normalisation existed
        carried.reward_moments.load_state_dict(mine["reward_moments"])
    rng = mine["rng"][at.rank % len(mine["rng"])]
    torch.set_rng_state(rng["torch"])
    carried.generator.set_state(rng["shuffle"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return mine["client"]
