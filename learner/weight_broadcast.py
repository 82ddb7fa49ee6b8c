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
import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

ALIGN = 64  # bytes: every tensor starts at a multiple of this inside its bucket


class Segment(Protocol):
    """Shared memory every member can map (`learner.shared_bundle.SharedSegment`)."""

    def resize(self, nbytes: int) -> torch.Tensor: ...  # its first `nbytes` bytes, flat uint8

    def describe(self) -> dict: ...  # what a receiver maps it by: path and bytes


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
class Layout:
    """Where each tensor goes: the header's entries (name, dtype, shape, bucket, byte offset, bytes; or
    `same_as` for a tied name) and the bytes of every bucket."""

    entries: list[dict] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def segment_offsets(self) -> list[int]:
        """Start of each bucket in one flat segment holding them all (`ALIGN`-aligned)."""
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at += -(-size // ALIGN) * ALIGN
        return out

    def segment_bytes(self) -> int:
        return self.segment_offsets()[-1] + self.sizes[-1] if self.sizes else 0


def plan_layout(specs: list[tuple[str, torch.dtype, tuple[int, ...], object]], bucket_bytes: int) -> Layout:
    """Cut tensors given as `(name, dtype, shape, tie)` (in order) into buckets of at most
    `bucket_bytes` (a larger tensor alone), each tensor at an `ALIGN`-aligned offset; a name whose `tie`
    equals an earlier one's is an alias entry of it (tied weights travel once)."""
    layout = Layout()
    seen: dict[object, str] = {}
    for name, dtype, shape, tie in specs:
        if tie in seen:
            layout.entries.append({"name": name, "same_as": seen[tie]})
            continue
        seen[tie] = name
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-layout.sizes[-1] // ALIGN) * ALIGN if layout.sizes else 0
        if not layout.sizes or (layout.sizes[-1] and start + nbytes > bucket_bytes):
            layout.sizes.append(0)
            start = 0
        layout.entries.append(
            {
                "name": name,
                "dtype": str(dtype).removeprefix("torch."),
                "shape": list(shape),
                "bucket": len(layout.sizes) - 1,
                "offset": start,
                "nbytes": nbytes,
            }
        )
        layout.sizes[-1] = start + nbytes
    return layout


def state_layout(state: dict[str, torch.Tensor], bucket_bytes: int) -> Layout:
    """`plan_layout` of a bundle; tensors sharing storage (same data, dtype, shape, strides) are tied."""
    return plan_layout(
        [
            (name, t.dtype, tuple(t.shape), (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())))
            for name, t in state.items()
        ],
        bucket_bytes,
    )


def bucket_parts(state: dict[str, torch.Tensor], layout: Layout) -> list[list[torch.Tensor]]:
    """The flat bytes of each bucket of `layout` in order, zero padding up to each aligned offset."""
    parts: list[list[torch.Tensor]] = [[] for _ in layout.sizes]
    ends = [0] * len(layout.sizes)
    for e in layout.entries:
        if "same_as" in e:
            continue
        k = e["bucket"]
        if e["offset"] > ends[k]:
            parts[k].append(torch.zeros(e["offset"] - ends[k], dtype=torch.uint8))
        parts[k].append(state[e["name"]].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
        ends[k] = e["offset"] + e["nbytes"]
    return parts


def write_state(state: dict[str, torch.Tensor], layout: Layout, segment: torch.Tensor) -> None:
    """Copy `state`'s tensors into `segment` (flat uint8) at their places in `layout` (those already
    there, views of the segment, stay)."""
    offsets = layout.segment_offsets()
    for e in layout.entries:
        if "same_as" not in e:
            at = offsets[e["bucket"]] + e["offset"]
            dst = segment[at : at + e["nbytes"]]
            src = state[e["name"]].detach().contiguous().reshape(-1).view(torch.uint8)
            if src.data_ptr() != dst.data_ptr():  # a bundle exported into the segment is there already
                dst.copy_(src)


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


def send_header(
    group: dist.ProcessGroup,
    version: int,
    layout: Layout,
    timeout_s: float,
    device: torch.device | str = "cpu",
    shared: dict | None = None,
) -> None:
    """Broadcast the bundle's header (its length first); `shared` (path and size of a shared-memory
    segment holding every bucket at `layout.segment_offsets()`) tells receivers to read the buckets
    there instead of waiting for their broadcasts."""
    head = {"version": int(version), "sizes": layout.sizes, "entries": layout.entries}
    if shared is not None:
        head["shared"] = {**shared, "offsets": layout.segment_offsets()}
    header = json.dumps(head).encode()
    broadcast(group, torch.tensor([len(header)], dtype=torch.int64, device=device), timeout_s, "header")
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    broadcast(group, payload, timeout_s, "header")


def broadcast_state(
    group: dist.ProcessGroup,
    state: dict[str, torch.Tensor],
    version: int,
    bucket_bytes: int,
    timeout_s: float,
    device: torch.device | str = "cpu",
    segment: Segment | None = None,
) -> int:
    """Send `state` tagged `version` from rank 0 of `group`, one bucket at a time (built, sent, freed);
    with `segment` (every receiver on this host), the buckets are copied there and only the header is
    broadcast. Returns the payload bytes. Raises `WeightBroadcastError` naming the part that failed."""
    layout = state_layout(state, bucket_bytes)
    if segment is not None:
        write_state(state, layout, segment.resize(layout.segment_bytes()))
        send_header(group, version, layout, timeout_s, device, segment.describe())
        return sum(layout.sizes)
    send_header(group, version, layout, timeout_s, device)
    parts = bucket_parts(state, layout)
    n = len(parts)
    for k in range(n):
        pieces, parts[k] = parts[k], []
        bucket = torch.cat(pieces).to(device) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
        broadcast(group, bucket, timeout_s, f"bucket {k + 1} of {n} of v{version}")
        del pieces, bucket
    return sum(layout.sizes)
