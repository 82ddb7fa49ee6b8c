"""Learner rank 0 -> rollout engines: the weight bundle broadcast over a process group of its own.

The group holds learner rank 0 (rank 0 of the group) and every process that holds a rollout
engine's weights: a hf worker itself, and each of a vLLM engine's worker processes (one per
tensor-parallel rank), which join from inside vLLM (`rollout_workers.vllm_engine`). It is separate
from the learners' training world and rendezvouses at its own TCPStore on rank 0's node; gloo
between CPU processes, NCCL between GPUs (the same calls, buckets on the device). One broadcast carries:

1. the header length (int64 [1]) and the header, JSON bytes: the version, the bucket sizes, and every
   tensor's name, dtype, shape, bucket and byte offset (offsets aligned to `ALIGN` bytes, so a
   receiver views each tensor in its bucket without a copy; a name tied to an earlier one is sent
   once, as `same_as`);
2. the buckets: flat uint8 buffers of at most `bucket_bytes` (a larger tensor gets its own bucket),
   which receivers load one at a time (`rollout_workers.weight_receiver`).

Every collective waits at most `timeout_s`: a receiver that died or stopped answering makes the
broadcast raise `WeightBroadcastError` naming the bucket, never hang.
"""

from __future__ import annotations

import contextlib
import gc
import json
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

ALIGN = 64  # bytes: every tensor starts at a multiple of this inside its bucket


class WeightBroadcastError(RuntimeError):
    """A broadcast of the weight group failed or timed out (a member died or stopped answering)."""


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
) -> dist.ProcessGroup:
    """A `backend` ('gloo' or 'nccl') group of `world_size` processes rendezvousing at host:port (rank 0
    hosts the store); every collective on it fails after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend != "gloo":
        raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


@dataclass
class BucketPlan:
    """Where each tensor goes: the header's entries and, per bucket, the tensors in it (flat bytes)."""

    entries: list[dict] = field(default_factory=list)
    buckets: list[list[torch.Tensor]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def plan_buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> BucketPlan:
    """Cut `state` (in order) into buckets of at most `bucket_bytes` (a larger tensor alone), each tensor
    at an `ALIGN`-aligned offset; a tensor sharing storage with an earlier name is an alias entry."""
    plan = BucketPlan()
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if key in seen:
            plan.entries.append({"name": name, "same_as": seen[key]})
            continue
        seen[key] = name
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        start = -(-plan.sizes[-1] // ALIGN) * ALIGN if plan.sizes else 0
        if not plan.sizes or (plan.sizes[-1] and start + flat.numel() > bucket_bytes):
            plan.buckets.append([])
            plan.sizes.append(0)
            start = 0
        if start > plan.sizes[-1]:  # padding up to the aligned offset
            plan.buckets[-1].append(torch.zeros(start - plan.sizes[-1], dtype=torch.uint8))
        plan.entries.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "bucket": len(plan.buckets) - 1,
                "offset": start,
                "nbytes": flat.numel(),
            }
        )
        plan.buckets[-1].append(flat)
        plan.sizes[-1] = start + flat.numel()
    return plan


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
    """One broadcast from group rank 0, waited on for at most `timeout_s`."""
    try:
        work = group.broadcast([tensor], dist.BroadcastOptions())
        if not work.wait(timedelta(seconds=timeout_s)):
            raise WeightBroadcastError(f"{what}: not done within {timeout_s:.0f}s")
    except WeightBroadcastError:
        raise
    except RuntimeError as err:  # gloo/NCCL: a peer closed the connection, or the wait timed out
        raise WeightBroadcastError(f"{what}: {str(err).splitlines()[0][:300]}") from err


def close_group(group: dist.ProcessGroup) -> None:
    """Close the group's connections after a failed broadcast, so members still waiting on rank 0 fail
    at once instead of waiting out the timeout: abort it, then drop the last references (the caller
    holds none after this) so its connections close."""
    with contextlib.suppress(RuntimeError):  # already broken beyond closing
        group.abort()
    del group
    gc.collect()


def broadcast_state(
    group: dist.ProcessGroup,
    state: dict[str, torch.Tensor],
    version: int,
    bucket_bytes: int,
    timeout_s: float,
    device: torch.device | str = "cpu",
) -> int:
    """Send `state` tagged `version` from rank 0 of `group`, one bucket at a time (built, sent, freed);
    returns the payload bytes sent. Raises `WeightBroadcastError` naming the part that failed."""
    plan = plan_buckets(state, bucket_bytes)
    header = json.dumps({"version": int(version), "sizes": plan.sizes, "entries": plan.entries}).encode()
    n = len(plan.buckets)
    broadcast(group, torch.tensor([len(header)], dtype=torch.int64, device=device), timeout_s, "header")
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    broadcast(group, payload, timeout_s, "header")
    for k in range(n):
        parts, plan.buckets[k] = plan.buckets[k], []
        bucket = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        broadcast(group, bucket, timeout_s, f"bucket {k + 1} of {n} of v{version}")
        del parts, bucket
    return sum(plan.sizes)
