"""A CUDA buffer shared between processes on one device: the handle's description, made by the process
that owns the buffer and opened by another (`rollout.weight_transport: cuda_ipc`).

The learner side (`learner.cuda_ipc_bundle`) and the receiving side (`rollout_workers.weight_receiver`)
both use this file, the one place the description's format is defined. A description is JSON-safe:

    {"kind": "cuda_ipc", "bytes": n, "device_uuid": "GPU-...", "handle": base64(pickle(args))}

`args` are what `torch.multiprocessing.reductions.reduce_tensor` gives for the buffer (the storage's
cudaIpcMemHandle, its offset and size, the producer's reference counter and event): the same handles
torch's own CUDA tensor sharing between processes sends. The opener rebuilds the tensor with torch's
`rebuild_cuda_tensor` on its own index of the device whose UUID is `device_uuid` (two processes may
number the devices differently: Ray gives each actor its own CUDA_VISIBLE_DEVICES). Only processes on
one node and one device can open a handle (CUDA IPC does not cross devices here, nor nodes).

The owner keeps the buffer alive while anyone may read it; writes are finished (`torch.cuda.synchronize`)
before a description is handed out (`describe`), so an opener reads complete data.
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

import torch

KIND = "cuda_ipc"
_DEVICE_ARG = 6  # the storage's device index in reduce_tensor's args for a CUDA tensor (torch 2.x)


def device_uuid(index: int | None = None) -> str | None:
    """The UUID of CUDA device `index` (the current one by default), None where CUDA is not available."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if index is None else index
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the CUDA device whose UUID is `uuid` (ValueError when it sees none)."""
    if not torch.cuda.is_available():
        raise ValueError(f"CUDA device {uuid} cannot be opened here: torch.cuda is not available")
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise ValueError(f"CUDA device {uuid} is not among this process's {torch.cuda.device_count()} devices")


def describe(buffer: torch.Tensor) -> dict[str, Any]:
    """The description another process opens `buffer` by (a contiguous CUDA tensor, flat uint8)."""
    if buffer.device.type != "cuda":
        raise ValueError(f"a CUDA IPC handle needs a CUDA tensor, got one on {buffer.device}")
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.synchronize(buffer.device)  # every write to it is done before anyone reads
    _, args = reduce_tensor(buffer)
    return {
        "kind": KIND,
        "bytes": buffer.numel() * buffer.element_size(),
        "device_uuid": device_uuid(buffer.device.index),
        "handle": base64.b64encode(pickle.dumps(args)).decode(),
    }


def open_buffer(description: dict[str, Any]) -> torch.Tensor:
    """The buffer `description` names, mapped into this process on its own index of that device."""
    if description.get("kind") != KIND:
        raise ValueError(f"not a CUDA IPC description: kind {description.get('kind')!r}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = local_index(description["device_uuid"])  # this process sees that device, or ValueError
    args = list(pickle.loads(base64.b64decode(description["handle"])))
    args[_DEVICE_ARG] = index
    return rebuild_cuda_tensor(*args)
