"""A learner checkpoint any number of ranks can load: full fp32 weights and Adam state in safetensors.

DeepSpeed's own checkpoints are per-rank ZeRO partitions: resuming with another `learner.num_ranks`
needs its offline `ds_to_universal` conversion, and the universal loader reads with
`torch.load(weights_only=False)` (refused by learner.safe_checkpoint). This format is consolidated at
save time instead, through DeepSpeed's public full-state accessors (`deepspeed.utils`
`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`, and `safe_set_*` to write back), which
know every ZeRO stage's and offload's layout:

- `shard-NNNNN.safetensors`: per trainable parameter (module names, tied weights once) the fp32
  master weight `fp32/<name>` and each per-element optimizer state `<key>/<name>` (Adam: exp_avg,
  exp_avg_sq), parameters grouped in buckets of at most `bucket_bytes` full-size fp32 bytes;
- `learner_extra.pt`: the caller's client state, KL controller and every rank's RNG (weights-only);
- `learner_index.json` (written last): format, shards, shapes, the optimizer's scalar state (step),
  learning rates, LR-schedule state and DeepSpeed's step counters.

Rank 0 writes every file; reading a full tensor is a collective (ZeRO-2 all-reduces, ZeRO-3
all-gathers one parameter), so every rank walks the same parameters in the same order and the extra
memory is one bucket on rank 0 and one parameter elsewhere. Every rank reads what it needs from the
files (safetensors: no code runs) and keeps its own partition, whatever the world size it was
written with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from learner.gather import buckets, full_shape
from learner.safe_checkpoint import safe_torch_load

FORMAT = "rayppo-learner-consolidated/1"
INDEX = "learner_index.json"
EXTRA = "learner_extra.pt"


def is_consolidated(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


def _trainable(engine) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _base_optimizer(engine) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed's ZeRO wrapper steps (torch AdamW or DeepSpeedCPUAdam)."""
    return engine.optimizer.optimizer


def _flat_partitions(engine) -> list[torch.Tensor]:
    """The flat fp32 partitions the base optimizer keeps state for: ZeRO-3 lists them itself (it
    hands them to the optimizer's param groups only for the duration of a step); ZeRO-1/2 leaves them
    in the param groups."""
    zero3 = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if zero3 is not None:
        return list(zero3)
    return [p for g in _base_optimizer(engine).param_groups for p in g["params"]]


def _optimizer_layout(engine) -> tuple[list[str], dict[str, float]]:
    """Per-element state keys (tensors shaped like the flat fp32 partition) and scalar state (step) of
    the base optimizer; ([], {}) before its first step (no state yet)."""
    flats = _flat_partitions(engine)
    state = _base_optimizer(engine).state.get(flats[0]) if flats else None
    if not state:
        return [], {}
    keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == flats[0].shape)
    scalars = {}
    for k, v in state.items():
        if k in keys:
            continue
        if not isinstance(v, int | float) and not (torch.is_tensor(v) and v.numel() == 1):
            raise TypeError(f"optimizer state {k!r} of type {type(v).__name__} cannot be consolidated")
        scalars[k] = float(v)
    return keys, scalars


def _scalar(opt: torch.optim.Optimizer, value: float):
    """A scalar state entry as `opt` keeps it: torch's own optimizers keep a float32 tensor (CPU unless
    capturable/fused), DeepSpeedCPUAdam a Python int."""
    if type(opt).__module__.startswith("torch.optim"):
        return torch.tensor(value, dtype=torch.float32)
    return int(value) if float(value).is_integer() else value


def save(engine, path: str | Path, rank: int, bucket_bytes: int, extra: dict) -> None:
    """Write the consolidated checkpoint of `engine` into the folder `path` (a collective: all ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    path = Path(path)
    keys, scalars = _optimizer_layout(engine)
    if keys:
        _link_optimizer_state(engine)
    params = _trainable(engine)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    index: dict = {"format": FORMAT, "params": {}, "optimizer_keys": keys, "optimizer_scalars": scalars}
    # Rank 0 holds the bucket's fp32 master weights and each per-element state: 4 bytes apiece.
    for i, bucket in enumerate(buckets(params, bucket_bytes, element_bytes=4 * (1 + len(keys)))):
        shard = f"shard-{i:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, p in bucket:
            parts = {"fp32": safe_get_full_fp32_param(p)}
            parts.update({key: safe_get_full_optimizer_state(p, key) for key in keys})
            if rank == 0:
                for key, t in parts.items():
                    tensors[f"{key}/{name}"] = t.detach().to("cpu", torch.float32).contiguous()
                index["params"][name] = {"shard": shard, "shape": list(full_shape(p))}
            del parts
        if rank == 0:
            save_file(tensors, str(path / shard))
        del tensors
    if rank == 0:
        opt = engine.optimizer
        index["lr"] = [g["lr"] for g in opt.param_groups]
        index["lr_scheduler"] = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
        index["engine"] = {
            "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples),
            "skipped_steps": int(engine.skipped_steps),
        }
        torch.save(extra, path / EXTRA)
        tmp = path / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, path / INDEX)
    if dist.is_initialized():
        dist.barrier()


def _ensure_optimizer_state(engine, keys: list[str], scalars: dict[str, float]) -> None:
    """Give the optimizer the state entries the checkpoint fills (zeros when it never stepped, then
    overwritten) and its scalars (step); ZeRO-1/2's per-parameter views of that state are linked by
    DeepSpeed after the first step, so a never-stepped engine is linked here."""
    opt = _base_optimizer(engine)
    for flat in _flat_partitions(engine):
        state = opt.state[flat]
        for key in keys:
            if key not in state:
                state[key] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        for key, value in scalars.items():
            state[key] = _scalar(opt, value)
    if keys:
        _link_optimizer_state(engine)


def _link_optimizer_state(engine) -> None:
    """(Re)link ZeRO-1/2's per-parameter views of the optimizer state to the state of every group.

    DeepSpeed links them once, right after the FIRST param group's first step, when the later groups
    (e.g. the value head's own group with `learner.value_lr`) have no state yet; their views then stay
    empty ("exp_avg not found in optimizer state fragment"). Linking again is idempotent."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    zero = engine.optimizer
    lows, flats = getattr(zero, "bit16_groups", None), getattr(zero, "single_partition_of_fp32_groups", None)
    if lows is None or flats is None:  # ZeRO-3 keeps no such views
        return
    state = _base_optimizer(engine).state
    for low, flat in zip(lows, flats, strict=True):
        if state.get(flat):
            lazy_init_hp_params_optimizer_state(low, flat, state)


def _set_module_weight(p: torch.nn.Parameter, value: torch.Tensor) -> None:
    """The module's (training-dtype) copy of a parameter; ZeRO-3 re-partitions it from rank 0's copy."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if not dist.is_initialized() or dist.get_rank() == 0:
                p.data.copy_(value.reshape(p.shape))
    else:
        with torch.no_grad():
            p.data.copy_(value.reshape(p.shape))


def _set_fp32_state(p: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """This rank's part of the fp32 master weight (`key` None) or optimizer state `key` of `p`.

    ZeRO-3: rank r keeps elements [r*n, (r+1)*n) of the flattened parameter zero-padded to n x ranks
    (n = its partition size); DeepSpeed's full-value setter slices without allowing for that padding
    (a 1-element bias on 2 ranks fails), so the local setter gets the padded slice instead.
    """
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    if not hasattr(p, "ds_id"):
        if key is None:
            safe_set_full_fp32_param(p, value)
        else:
            safe_set_full_optimizer_state(p, value, key)
        return
    group = p.ds_process_group
    rank = dist.get_rank(group=group) if dist.is_initialized() else 0
    n = p.ds_tensor.numel()
    flat = value.reshape(-1)[rank * n : (rank + 1) * n]
    part = torch.cat([flat, flat.new_zeros(n - flat.numel())]) if flat.numel() < n else flat
    if key is None:
        safe_set_local_fp32_param(p, part)
    else:
        safe_set_local_optimizer_state(p, part, key)


def load(engine, path: str | Path) -> dict:
    """Load a consolidated checkpoint into `engine` (a collective: all ranks); returns the extra state."""
    path = Path(path)
    index = json.loads((path / INDEX).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{path / INDEX}: format {index.get('format')!r}, expected {FORMAT!r}")
    params = _trainable(engine)
    mine = {n: list(full_shape(p)) for n, p in params}
    theirs = {n: e["shape"] for n, e in index["params"].items()}
    if mine != theirs:
        missing = sorted(set(theirs) - set(mine))
        extra = sorted(set(mine) - set(theirs))
        reshaped = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        raise ValueError(
            f"checkpoint {path} does not fit this model: only in the checkpoint {missing[:5]}, only in the "
            f"model {extra[:5]}, different shapes {reshaped[:5]}"
        )
    keys, scalars = index["optimizer_keys"], index["optimizer_scalars"]
    _ensure_optimizer_state(engine, keys, scalars)
    by_shard: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in params:
        by_shard.setdefault(index["params"][name]["shard"], []).append((name, p))
    for shard in sorted(by_shard):
        with safe_open(str(path / shard), framework="pt") as f:
            for name, p in by_shard[shard]:
                fp32 = f.get_tensor(f"fp32/{name}")
                _set_module_weight(p, fp32)
                _set_fp32_state(p, fp32, None)
                for key in keys:
                    _set_fp32_state(p, f.get_tensor(f"{key}/{name}"), key)
    for group, lr in zip(engine.optimizer.param_groups, index["lr"], strict=True):
        group["lr"] = lr
    if index["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(index["lr_scheduler"])
    for attr, value in index["engine"].items():
        setattr(engine, attr, value)
    extra = safe_torch_load(path / EXTRA)
    if dist.is_initialized():
        dist.barrier()
    return extra


def read_weights(path: str | Path, prefix: str) -> dict[str, torch.Tensor]:
    """The fp32 master weights of the parameters named `prefix`... in the consolidated checkpoint at
    `path`, keyed without the prefix (`"policy."` gives the HF policy's own names). Reads files only:
    no engine, no torch.distributed, one tensor at a time."""
    path = Path(path)
    if not is_consolidated(path):
        raise ValueError(
            f"{path}: not a consolidated learner checkpoint (no {INDEX}); one written with "
            "learner.checkpoint_format: deepspeed holds ZeRO partitions that only a learner can load"
        )
    index = json.loads((path / INDEX).read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{path / INDEX}: format {index.get('format')!r}, expected {FORMAT!r}")
    by_shard: dict[str, list[str]] = {}
    for name, entry in index["params"].items():
        if name.startswith(prefix):
            by_shard.setdefault(entry["shard"], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(by_shard):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in by_shard[shard]:
                out[name[len(prefix) :]] = f.get_tensor(f"fp32/{name}")
    return out
