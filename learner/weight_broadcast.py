"""Learner rank 0 -> rollout workers: the weight bundle broadcast over a process group of its own.

The group holds learner rank 0 (rank 0 of the group) and the rollout workers (ranks 1..M); it is
separate from the learners' training world, built from its own TCPStore on rank 0's node (gloo on
CPU, so it runs in CI; NCCL on GPUs would use the same wire format). One broadcast carries:

1. the header length (int64 [1]) and the header, JSON bytes: the version, every tensor's name,
   dtype, shape, bucket and byte offset (a name tied to an earlier one is sent once, as `same_as`);
2. the buckets: flat uint8 buffers of at most `bucket_bytes` (a larger tensor gets its own bucket).

The receiving side (`rollout_workers.weight_receiver`) rebuilds the same named tensors from it.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist


def open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of `world_size` processes rendezvousing at host:port (rank 0 hosts the store)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _bcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()  # root rank 0 (the default option)


def broadcast_state(
    group: dist.ProcessGroup, state: dict[str, torch.Tensor], version: int, bucket_bytes: int
) -> int:
    """Send `state` tagged `version` from rank 0 of `group`; returns the payload bytes sent."""
    entries, buckets, sizes = [], [[]], [0]
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in seen:
            entries.append({"name": name, "same_as": seen[key]})
            continue
        seen[key] = name
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if sizes[-1] and sizes[-1] + flat.numel() > bucket_bytes:
            buckets.append([])
            sizes.append(0)
        entries.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "bucket": len(buckets) - 1,
                "offset": sizes[-1],
                "nbytes": flat.numel(),
            }
        )
        buckets[-1].append(flat)
        sizes[-1] += flat.numel()
    header = json.dumps({"version": int(version), "sizes": sizes, "entries": entries}).encode()
    _bcast(group, torch.tensor([len(header)], dtype=torch.int64))
    _bcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for parts in buckets:
        _bcast(group, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))
    return sum(sizes)
