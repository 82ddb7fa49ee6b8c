"""DeepSpeed config, optimizer, LR schedule and torch.distributed start-up for one learner rank.

CPU trap (DeepSpeed 0.19): `TorchBackend.__init__` JIT-builds the `deepspeed_shm_comm` op (about a
minute on 2 cores, the first time) whenever `deepspeed.ops.__compatible_ops__` says it can, and when
LOCAL_SIZE equals the world size each rank also maps a 69 MB `/dev/shm/deepspeed_allreduce_buffer_*`
file that nothing deletes. The op only serves `inference_all_reduce` (tensor-parallel inference), which
a ZeRO learner never calls, so `disable_shm_allreduce` marks it incompatible before the backend starts
(no env var or config key exists for this) and `remove_shm_buffers` deletes this rank's file anyway.

Start-up cost: importing DeepSpeed imports MLflow whenever it is installed (its autotuner's optional
tracking), about 1.1 s of CPU in every rank for a feature a learner never uses; `import_deepspeed`
hides MLflow for the length of that one import, so the rank starts without it and MLflow stays
importable afterwards.
"""

from __future__ import annotations

import copy
import glob
import os
import socket
import sys
from datetime import timedelta
from typing import Any

import torch

from learner.config import LearnerConfig
from learner.lr_schedule import build_scheduler

SHM_OP_NAME = "deepspeed_shm_comm"
SHM_BUFFER_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"


def resolve_backend(config: LearnerConfig) -> str:
    """'auto' means NCCL when this process sees a GPU, gloo otherwise."""
    if config.backend != "auto":
        return config.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` updated recursively by `override` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# DeepSpeed sizes ZeRO's buffers for GPUs: a 5e8-element gradient reduction bucket (1.9 GiB float32,
# touched as far as a step's gradients reach) and all-gather bucket, and under ZeRO-3 up to 1e9
# parameters kept gathered between uses. On a CPU rank (gloo) every byte of them is the machine's
# memory and nothing overlaps the collectives anyway, so they are sized for CPUs there (measured by
# bench/bench_zero_memory.py; the numbers each element is reduced to do not depend on the sizes).
# `learner.deepspeed_overrides` still sets any of them.
CPU_ZERO = {"reduce_bucket_size": 20_000_000, "allgather_bucket_size": 20_000_000}
CPU_ZERO3 = {
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_live_parameters": 20_000_000,
    "stage3_max_reuse_distance": 0,
}


def ds_config(config: LearnerConfig) -> dict[str, Any]:
    """The DeepSpeed config dict for a learner rank.

    `gradient_accumulation_steps` is 1 on purpose: a rank's shard size changes from step to step, so
    the PPO loop marks the accumulation boundary itself (`engine.set_gradient_accumulation_boundary`)
    and scales its losses so micro-batches and ranks add up to the whole-batch loss. On gloo (CPU
    ranks) ZeRO's buckets are sized for CPUs (`CPU_ZERO`, `CPU_ZERO3`).
    """
    zero: dict[str, Any] = {"stage": config.zero_stage}
    pin = resolve_backend(config) == "nccl"  # page-locked host buffers speed up GPU<->CPU copies only
    if not pin:  # gloo: CPU ranks
        zero.update(CPU_ZERO)
        if config.zero_stage == 3:
            zero.update(CPU_ZERO3)
    if config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if config.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if config.dtype == "bfloat16":
        # check_grad_overflow: a non-finite gradient norm skips the step (as in fp32), never applies it.
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": True}
    return deep_merge(cfg, config.deepspeed_overrides)


def build_optimizer(model: torch.nn.Module, config: LearnerConfig) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter: torch's (no JIT-built op needed), or DeepSpeed's
    DeepSpeedCPUAdam (the same decoupled-weight-decay update, in C++ on CPU) when the optimizer is
    offloaded: ZeRO-Offload steps the optimizer on CPU partitions and requires it.

    DeepSpeedCPUAdam JIT-compiles its `cpu_adam` op with g++/ninja the first time a machine uses it
    (measured: 2.5 min on 2 busy cores; cached under ~/.cache/torch_extensions afterwards).

    With `config.value_lr` set, the model's `value_head` is a second parameter group with that rate
    (Adam moves each weight by about its lr per step, so the critic's speed is set by its lr).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    head = getattr(model, "value_head", None)
    if config.value_lr is not None and head is not None:
        head_ids = {id(p) for p in head.parameters()}
        params = [
            {"params": [p for p in params if id(p) not in head_ids]},
            {"params": [p for p in params if id(p) in head_ids], "lr": config.value_lr},
        ]
        params = [g for g in params if g["params"]]  # a frozen head (no critic) leaves its group empty
    if config.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            params,
            lr=config.lr,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            adamw_mode=True,
        )
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.adam_betas,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        fused=True if config.fused_adam else None,  # None: torch's default implementation
    )


def import_deepspeed():
    """`import deepspeed`, without the MLflow import its autotuner makes (see module doc)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # makes `import mlflow` raise ImportError, which DeepSpeed catches
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def disable_shm_allreduce() -> None:
    """Keep DeepSpeed from building and mapping its shared-memory allreduce op (see module doc)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__[SHM_OP_NAME] = False


def shm_buffer_path(master_addr: str, master_port: int, rank: int) -> str:
    """The /dev/shm name DeepSpeed's shm op gives this rank's buffer (csrc/cpu/comm/shm.cpp)."""
    return f"{SHM_BUFFER_PREFIX}_{os.getuid()}_{master_addr}_{master_port}_{rank}"


def remove_shm_buffers(master_addr: str, master_port: int, rank: int) -> list[str]:
    """Delete this rank's DeepSpeed shm allreduce buffer, if one was made; returns what was removed."""
    removed = []
    for path in glob.glob(shm_buffer_path(master_addr, master_port, rank)):
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def node_ip() -> str:
    """This node's address as Ray knows it (127.0.0.1 outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker any failure means "no Ray address"
        pass
    return "127.0.0.1"


def free_port() -> int:
    """A TCP port free right now on this node (the rendezvous store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, backend: str, timeout_s: float
) -> None:
    """Join the learner's torch.distributed world through DeepSpeed (env:// rendezvous).

    Under Ray each rank sees only its own GPU(s), so the local device index is always 0.
    """
    deepspeed = import_deepspeed()

    os.environ.update(
        MASTER_ADDR=str(master_addr),
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
    )
    # LOCAL_SIZE is what makes DeepSpeed's shm op map /dev/shm buffers; never inherit one.
    os.environ.pop("LOCAL_SIZE", None)
    if backend == "nccl":
        torch.cuda.set_device(0)
    disable_shm_allreduce()
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, timeout=timedelta(seconds=timeout_s), verbose=False
    )
    check_world(rank, world_size)


def check_world(rank: int, world_size: int) -> None:
    """Raise unless this process's default torch.distributed world is the learner's: `world_size`
    ranks, this one `rank`.

    DeepSpeed (like torch) adopts a default process group that already exists in the process, whatever
    its size: one created by another library first (vLLM's in-process engine makes a world of its own
    size 1) would make every gradient all-reduce a no-op, each rank silently training on its shard alone.
    """
    import torch.distributed as dist

    got = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    if got != (rank, world_size):
        seen = f"rank {got[0]} of a world of {got[1]}" if got else "no initialised world"
        raise RuntimeError(
            f"learner rank {rank} of {world_size}: torch.distributed has {seen} after DeepSpeed's init. "
            "Something in this process initialised torch.distributed before the learner (e.g. an "
            "in-process vLLM engine built before LearnerRank.setup) and DeepSpeed reused that world; "
            "set the learner up first"
        )


def initialize_engine(model: torch.nn.Module, config: LearnerConfig):
    """`deepspeed.initialize` with AdamW (`build_optimizer`) and the LR schedule (`learner.lr_schedule`);
    returns the engine.

    Its checkpoint engine is swapped for a weights-only one (see learner.safe_checkpoint).
    """
    import deepspeed

    from learner.safe_checkpoint import install_safe_checkpoint_engine

    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(config)
    )
    install_safe_checkpoint_engine(engine)
    return engine


def single_process_engine(model: torch.nn.Module, config: LearnerConfig):
    """`initialize_engine` in a one-rank world: the world this process holds already (it must be rank 0
    of 1, `check_world`), else one started here on a free local port. What a Tinker tenant trains with
    (`cluster.serve.tenant`, one process per tenant): the learner's engine, optimizer and ZeRO stage."""
    import torch.distributed as dist

    if not dist.is_initialized():
        init_distributed(0, 1, "127.0.0.1", free_port(), resolve_backend(config), config.dist_timeout_s)
    check_world(0, 1)
    return initialize_engine(model, config)
