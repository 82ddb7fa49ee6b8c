"""Weight bundles through shared memory: the collective path's transport when the learner ranks and
every process of the weight group share one host.

Over gloo, rank 0 gathers the bundle from the other ranks, casts it, copies it into buckets and sends
every byte through a socket to each receiver. On one host none of that is needed: every learner rank
writes its own part, cast to the export dtype, straight into a shared-memory segment (a file under
/dev/shm that every member maps) at the place `learner.weight_broadcast.plan_layout` gives it; the
ranks meet at a barrier; rank 0 reads the bundle back as views of the segment (its probe, checksum
and digest) and broadcasts only the header; each receiver views its tensors in the segment and copies
them into its engine (`rollout_workers.weight_receiver`).

A rank's part of each tensor: under ZeRO-3, its partition (rank r holds elements [r p, (r+1) p) of the
flattened tensor, p = `ds_tensor.ds_numel`, the last partition padded: DeepSpeed's
`partition_parameters`), read where it lies, nothing gathered; a full tensor (ZeRO-1/2, a buffer) is
split into `world` equal element ranges, so the ranks share the cast.

The segment is kept from push to push (its pages are faulted in once). Learner rank 0 owns it: the
file name carries its pid, it is removed when rank 0's segment is dropped or its process exits, and a
segment whose owner died without removing it is removed when a new one is made.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from pathlib import Path

import torch

from learner.gather import full_numel, full_shape
from learner.weight_broadcast import Layout, plan_layout

PREFIX = "rayppo-weights-"
DEFAULT_DIR = "/dev/shm"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def room(directory: str = DEFAULT_DIR) -> int:
    """Bytes free for segments in `directory` (a tmpfs: what the node's /dev/shm can still hold)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def remove_orphans(directory: str) -> list[str]:
    """Remove the segments in `directory` whose owner process is gone; returns their paths."""
    gone = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _unlink(str(path))
            gone.append(str(path))
        except PermissionError:  # alive, another user's
            pass
    return gone


class SharedSegment:
    """A file under /dev/shm mapped read-write: `resize(n)` gives its first n bytes as a flat uint8
    tensor (mapped again only when n changes). `create` makes a new one owned by this process (removed
    when the object is dropped or the process exits); `SharedSegment(path)` opens an existing one."""

    def __init__(self, path: str, owner: bool = False) -> None:
        self.path = str(path)
        self._size = -1
        self._tensor: torch.Tensor | None = None
        self._finalizer = weakref.finalize(self, _unlink, self.path) if owner else None

    @classmethod
    def create(cls, directory: str = DEFAULT_DIR) -> SharedSegment:
        remove_orphans(directory)
        path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        return cls(path, owner=True)

    def resize(self, nbytes: int) -> torch.Tensor:
        """The segment's first `nbytes` bytes (the file is grown or cut to exactly that: every writer
        asks for the same size)."""
        if nbytes != self._size:
            self._tensor = None  # a view handed out earlier keeps its own mapping alive
            fd = os.open(self.path, os.O_RDWR)
            try:
                os.ftruncate(fd, nbytes)
                if nbytes:  # reserved now: a full /dev/shm is an error here, not a SIGBUS on a write
                    try:
                        os.posix_fallocate(fd, 0, nbytes)
                    except OSError as err:
                        raise OSError(
                            err.errno,
                            f"the shared weight segment {self.path} cannot hold {nbytes / 2**20:.0f} MiB "
                            f"({err.strerror}; {room(os.path.dirname(self.path)) / 2**20:.0f} MiB free there): "
                            "give the node a larger /dev/shm, or set rollout.weight_transport: broadcast",
                        ) from err
                buffer = mmap.mmap(fd, nbytes) if nbytes else bytearray()
            finally:
                os.close(fd)
            self._tensor = (
                torch.frombuffer(buffer, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            )
            self._size = nbytes
        return self._tensor

    def describe(self) -> dict:
        """What a receiver needs to map it: path and size."""
        return {"path": self.path, "bytes": self._size}

    def remove(self) -> None:
        """Remove the file now (the owner's; mappings stay valid until dropped)."""
        if self._finalizer is not None:
            self._finalizer()


def export_layout(state: dict[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None) -> Layout:
    """The layout of the bundle `learner.gather.cpu_state_dict(state, .., dtype)` would give, planned from
    `state` (a `state_dict(keep_vars=True)`, ZeRO-3 partitioned or not) alone: the same names, order,
    full shapes, dtypes (floating ones as `dtype`) and ties (one Parameter under several names). Every
    rank computes the same one."""
    return plan_layout(
        [
            (name, dtype if dtype is not None and t.is_floating_point() else t.dtype, full_shape(t), id(t))
            for name, t in state.items()
        ],
        bucket_bytes,
    )


def write_rank_part(
    state: dict[str, torch.Tensor], layout: Layout, segment: torch.Tensor, rank: int, world: int
) -> int:
    """Write this rank's part of every tensor of `state` into `segment` at its place in `layout`, cast
    to the entry's dtype (see the module docstring); returns the elements written."""
    offsets = layout.segment_offsets()
    written = 0
    for e in layout.entries:
        if "same_as" in e:
            continue
        t = state[e["name"]]
        at = offsets[e["bucket"]] + e["offset"]
        dst = segment[at : at + e["nbytes"]].view(getattr(torch, e["dtype"]))
        n = full_numel(t)
        part = getattr(t, "ds_tensor", None)
        if part is not None:
            size = int(part.ds_numel)
            if size * world < n:
                raise RuntimeError(
                    f"{e['name']}: ZeRO-3 partitions of {size} elements on {world} ranks cannot hold {n}"
                    " (a partition group smaller than the world is not supported by the shared-memory export)"
                )
            start, src = size * rank, part.detach().reshape(-1)
            count = max(0, min(size, n - start))
            src = src[:count]
        else:
            per = -(-n // world)
            start = min(n, rank * per)
            count = min(n, start + per) - start
            src = t.detach().reshape(-1)[start : start + count]
        if count:
            dst[start : start + count].copy_(src)
        written += count
    return written


def segment_views(layout: Layout, segment: torch.Tensor) -> dict[str, torch.Tensor]:
    """The bundle as views of `segment` under its names and order (a tied name shares its source's)."""
    offsets = layout.segment_offsets()
    views: dict[str, torch.Tensor] = {}
    for e in layout.entries:
        if "same_as" in e:
            views[e["name"]] = views[e["same_as"]]
            continue
        at = offsets[e["bucket"]] + e["offset"]
        views[e["name"]] = segment[at : at + e["nbytes"]].view(getattr(torch, e["dtype"])).view(e["shape"])
    return views
