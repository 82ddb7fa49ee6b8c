"""DeepSpeed checkpoints loaded with `torch.load(weights_only=True)`: a checkpoint file never runs code.

DeepSpeed 0.19.8's `TorchCheckpointEngine.load` calls `torch.load(..., weights_only=False)`, i.e. it
unpickles anything. No config key names a checkpoint-engine class: `_configure_checkpointing` stores
what `create_checkpoint_engine` picked (`TorchCheckpointEngine` unless `checkpoint.writer` or
`datastates_ckpt` is configured) in the public `engine.checkpoint_engine` attribute, and every file
our load path reads goes through it: the `*model_states.pt` files (`SDLoaderFactory` loader) and
the `*optim_states.pt` ZeRO partitions (`_get_all_zero_checkpoint_state_dicts`). Replacing that
attribute with `SafeTorchCheckpointEngine` makes all of them weights-only. Paths that call
`torch.load` themselves are kept out: universal checkpoints (`checkpoint.load_universal`) are refused,
and `load_checkpoint_safely` always loads optimizer states (under ZeRO-3, `load_optimizer_states=False`
reads the fp32 weights through `zero_to_fp32` with weights_only=False).

What the checkpoints hold besides tensors and plain containers (found with
`torch.serialization.get_unsafe_globals_in_checkpoint` over ZeRO-2/3, fp32/bf16 saves): only the
optimizer-state files, with the three classes of `SAFE_CHECKPOINT_GLOBALS`. Allow-listing a class
lets a file call `cls(*args)` / `cls.__new__(cls, *args)` and fill the instance's `__dict__` with
weights-only values (tensors, numbers, strings, containers); these three have no `__setstate__` and
constructors that only store numbers, so no code a file chooses can run. They are allowed only for the
duration of our own loads (`torch.serialization.safe_globals`), never process-wide.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

SAFE_CHECKPOINT_GLOBALS: tuple[type, ...] = (
    ZeroStageEnum,  # int enum: the ZeRO stage of the optimizer state ("zero_stage")
    LossScaler,  # static loss scaler ("loss_scaler"): cur_scale and a dynamic flag
    fragment_address,  # dataclass(numel: int, start: int): ZeRO-2 "param_slice_mappings"
)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds something a weights-only load refuses (possibly code); nothing was run."""


def _reason(err: Exception) -> str:
    """The line of torch's weights-only error naming the refused global, without its advice to allow it."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [repr(err)]
    line = next((x for x in lines if "GLOBAL" in x or "global" in x), lines[0])
    return line.split(" Please use")[0]


def safe_torch_load(path: str | Path, map_location: Any = None) -> Any:
    """`torch.load(weights_only=True)` with DeepSpeed's own harmless classes allowed for this call only."""
    with torch.serialization.safe_globals(list(SAFE_CHECKPOINT_GLOBALS)):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"refusing to load checkpoint file {str(path)!r}: it holds objects outside the weights-only "
                f"allow-list, so it was not unpickled ({_reason(err)})"
            ) from err


class SafeTorchCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine with a weights-only `load`; saving is unchanged."""

    def load(self, path: str, map_location=None):
        return safe_torch_load(path, map_location=map_location)


def install_safe_checkpoint_engine(engine) -> None:
    """Make every checkpoint load of this DeepSpeed engine weights-only (call right after initialize)."""
    current = getattr(engine, "checkpoint_engine", None)
    if isinstance(current, SafeTorchCheckpointEngine):
        return
    if type(current) is not TorchCheckpointEngine:
        raise ValueError(
            f"DeepSpeed picked checkpoint engine {type(current).__name__}; only the default "
            "TorchCheckpointEngine can be made weights-only: remove 'checkpoint.writer' / "
            "'datastates_ckpt' from learner.deepspeed_overrides"
        )
    if engine.load_universal_checkpoint():
        raise ValueError(
            "'checkpoint.load_universal' in learner.deepspeed_overrides is not supported: DeepSpeed "
            "loads universal checkpoints with torch.load(weights_only=False), bypassing the checkpoint engine"
        )
    safe = SafeTorchCheckpointEngine(engine._config)
    safe.zipfile_serialization = current.zipfile_serialization
    engine.checkpoint_engine = safe


def load_checkpoint_safely(engine, path: str | Path) -> tuple[str | None, dict | None]:
    """`engine.load_checkpoint` of weights, optimizer and LR schedule, on the weights-only path only."""
    if not isinstance(getattr(engine, "checkpoint_engine", None), SafeTorchCheckpointEngine):
        raise RuntimeError(
            "engine has no SafeTorchCheckpointEngine: call install_safe_checkpoint_engine(engine) first"
        )
    return engine.load_checkpoint(
        str(path), load_optimizer_states=True, load_lr_scheduler_states=True, load_module_only=False
    )


def check_weights_only_loadable(obj: Any, what: str) -> None:
    """Fail at save time, not at resume time, if `obj` would not load under weights_only=True."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as err:
        raise TypeError(
            f"{what} must hold only tensors, numbers, strings, None and lists/tuples/dicts of them "
            f"(it is loaded with weights_only=True): {_reason(err)}"
        ) from None
