"""The receiving end of the learner's weight broadcast (see `learner.weight_broadcast` for the format).

A worker joins a process group of its own with learner rank 0 (group rank 0) and the other
workers, and rebuilds each broadcast bundle as named tensors that `RolloutWorker.load_weights`
takes like an object-store bundle (same checks, same acknowledgement).
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """Join the gloo group at host:port (hosted by learner rank 0) as `rank`."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _bcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.Tensor:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()
    return tensor


def receive_state(group: dist.ProcessGroup) -> tuple[int, dict[str, torch.Tensor]]:
    """Block until the next bundle arrives; returns (version, named tensors)."""
    length = int(_bcast(group, torch.zeros(1, dtype=torch.int64)).item())
    header = json.loads(bytes(_bcast(group, torch.empty(length, dtype=torch.uint8)).numpy()))
    buckets = [_bcast(group, torch.empty(size, dtype=torch.uint8)) for size in header["sizes"]]
    state: dict[str, torch.Tensor] = {}
    for e in header["entries"]:
        if "same_as" in e:
            state[e["name"]] = state[e["same_as"]]
            continue
        raw = buckets[e["bucket"]][e["offset"] : e["offset"] + e["nbytes"]]
        # a copy: a view at an offset not aligned to the dtype's size cannot be reinterpreted in place
        state[e["name"]] = raw.clone().view(getattr(torch, e["dtype"])).reshape(e["shape"])
    return int(header["version"]), state
