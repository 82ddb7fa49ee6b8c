"""Full-size parameters a bucket at a time: the memory bound of weight export and checkpoints.

Under ZeRO-3 each rank holds a 1/world slice of every parameter; reading a full tensor is a
collective all-gather (`deepspeed.zero.GatheredParameters`). Gathering the whole model at once
costs every rank a full copy of it; here the parameters are walked in order and gathered in buckets
of at most `bucket_bytes` full-size bytes (a larger tensor is a bucket of its own), released before
the next bucket, so the extra memory on any rank is one bucket. Under ZeRO-2 every rank already
holds every full parameter and nothing is gathered. Every rank must walk the same buckets in the
same order (the gathers are collectives).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch


def full_numel(t: torch.Tensor) -> int:
    """Elements of the full tensor (a ZeRO-3 partitioned parameter reports its own in `ds_numel`)."""
    return int(getattr(t, "ds_numel", t.numel()))


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))


def group_tied(state: dict[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
    """`(names, tensor)` per distinct tensor object of a `state_dict(keep_vars=True)`, in first-seen order:
    tied weights (one Parameter under two names) are one entry, gathered and copied once."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), ([], t))[0].append(name)
    return list(groups.values())


def buckets(entries: list, bucket_bytes: int, element_bytes: int | None = None) -> list[list]:
    """Consecutive runs of `entries` (`(name(s), tensor)` pairs) whose full tensors add up to at most
    `bucket_bytes` (a tensor larger than that alone makes a bucket); `element_bytes` counts each element
    at that size instead of the tensor's own."""
    out: list[list] = []
    size = 0
    for key, t in entries:
        nbytes = full_numel(t) * (element_bytes or t.element_size())
        if not out or (size and size + nbytes > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append((key, t))
        size += nbytes
    return out


def gathered(tensors: list[torch.Tensor]):
    """Full data of the ZeRO-3 parameters among `tensors` for the duration of the block (collective);
    a no-op for anything else. Changes made inside are discarded."""
    params = [t for t in tensors if hasattr(t, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def stream_full_state(
    state: dict[str, torch.Tensor], bucket_bytes: int
) -> Iterator[list[tuple[list[str], torch.Tensor]]]:
    """Yield `state` (a `state_dict(keep_vars=True)`) bucket by bucket as `[(names, full tensor)]`; each
    bucket's tensors are full only until the next one is requested. Collective under ZeRO-3."""
    for bucket in buckets(group_tied(state), bucket_bytes):
        with gathered([t for _, t in bucket]):
            yield bucket


class ExportBuffer:
    """CPU storage that an export's copies are carved from, kept from one export to the next: a push then
    writes into memory it has already touched instead of allocating a new bundle (and taking its page
    faults: about 4x the cast itself on one CPU thread) every time. Pinned when CUDA is there, so the
    device-to-host copies run at the bus's speed.

    The storage is reused only when nothing outside holds any part of it (the storage's use count,
    which every view of it raises, however derived); otherwise the export gets a new one and the held
    bundle is never written over. `reused` says which happened last. For a bundle used in this process
    only (the broadcast): pickled, each view would carry the whole storage with it."""

    ALIGN = 64  # bytes: every view starts aligned for any dtype

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._offset = 0
        self.reused = False

    def _in_use(self) -> bool:
        count = getattr(torch._C, "_storage_Use_Count", None)
        if count is None:  # no way to tell: never write into storage that may be held
            return True
        storage = self._flat.untyped_storage()  # this temporary and self._flat are the two expected holders
        return count(storage._cdata) > 2

    def begin(self, nbytes: int) -> None:
        """Make room for `nbytes` (the coming export's copies, aligned as `take` aligns them)."""
        self.reused = self._flat is not None and self._flat.numel() >= nbytes and not self._in_use()
        if not self.reused:
            self._flat = None  # released before the new one is allocated
            self._flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._offset = 0

    @classmethod
    def aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` in the next free part of the storage."""
        nbytes = math.prod(shape) * dtype.itemsize
        start, self._offset = self._offset, self._offset + self.aligned(nbytes)
        if self._flat is None or self._offset > self._flat.numel():
            room = 0 if self._flat is None else self._flat.numel()
            raise RuntimeError(
                f"export buffer overrun: {self._offset} bytes taken, begin() made room for {room}"
            )
        return self._flat[start : start + nbytes].view(dtype).view(shape)


def cast_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """What an export casts `t` to: `dtype` for floating tensors (None: their own), integers never."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def cpu_state_dict(
    state: dict[str, torch.Tensor],
    bucket_bytes: int,
    keep: bool,
    dtype: torch.dtype | None = None,
    buffer: ExportBuffer | None = None,
) -> dict[str, torch.Tensor] | None:
    """Detached CPU copies of `state` under its own names and order (tied names share one tensor), built
    bucket by bucket, floating tensors cast to `dtype` on the way (None: their own); returns None where
    `keep` is False (those ranks only take part in the gathers). With `buffer` the copies are views of
    its storage (see ExportBuffer), otherwise tensors of their own."""
    copies: dict[str, torch.Tensor] = {}
    zero3 = any(hasattr(t, "ds_id") for t in state.values())
    if not keep and not zero3:
        return None  # nothing to gather: the other ranks need not walk the model at all
    if keep and buffer is not None:
        sizes = (full_numel(t) * cast_dtype(t, dtype).itemsize for _, t in group_tied(state))
        buffer.begin(sum(ExportBuffer.aligned(n) for n in sizes))
    for bucket in stream_full_state(state, bucket_bytes):
        if not keep:
            continue
        for names, t in bucket:
            copy = cpu_copy(t.detach(), cast_dtype(t, dtype), buffer)
            for name in names:
                copies[name] = copy
    return {name: copies[name] for name in state} if keep else None


def cpu_copy(t: torch.Tensor, dtype: torch.dtype, buffer: ExportBuffer | None = None) -> torch.Tensor:
    """A contiguous CPU copy of the full tensor `t` in `dtype`: a view of `buffer`'s storage when given."""
    if buffer is None:
        return t.to("cpu", dtype=dtype, copy=True).contiguous()
    out = buffer.take(tuple(t.shape), dtype)
    out.copy_(t)
    return out
