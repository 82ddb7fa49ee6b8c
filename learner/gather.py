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


def cpu_state_dict(
    state: dict[str, torch.Tensor], bucket_bytes: int, keep: bool, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """Detached CPU copies of `state` under its own names and order (tied names share one tensor), built
    bucket by bucket, floating tensors cast to `dtype` on the way (None: their own); returns None where
    `keep` is False (those ranks only take part in the gathers)."""
    copies: dict[str, torch.Tensor] = {}
    zero3 = any(hasattr(t, "ds_id") for t in state.values())
    if not keep and not zero3:
        return None  # nothing to gather: the other ranks need not walk the model at all
    for bucket in stream_full_state(state, bucket_bytes):
        if not keep:
            continue
        for names, t in bucket:
            cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
            copy = t.detach().to("cpu", dtype=cast, copy=True).contiguous()
            for name in names:
                copies[name] = copy
    return {name: copies[name] for name in state} if keep else None
