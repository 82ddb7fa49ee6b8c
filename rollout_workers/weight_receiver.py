"""The receiving end of the learner's weight broadcast (format: `learner.weight_broadcast`).

Each process holding an engine's weights (a hf worker; every vLLM worker process, one per
tensor-parallel rank) joins learner rank 0's weight group and reads a bundle as a `BroadcastStream`:
the header first (version, names, shapes: checked before any weight changes), then the buckets one at
a time, each tensor a view into its bucket, handed to the engine's own loader as it arrives. The
peak extra memory is one bucket, not the model.

Leaving the `with` block always consumes the rest of the broadcast (a refused or failed load still
reads every bucket), so the group stays in step for its other members; only a failure of the
broadcast itself (a dead or silent peer, `WeightGroupError`) leaves it, and then the group is
unusable and is formed again. The digest of what arrived (`digest`) is the bundle's
`sampled_digest`, taken tensor by tensor.

When every member is on the learner's host, the header may name a shared-memory segment holding every
bucket (`learner.shared_bundle`): the buckets are then views of that segment, mapped read-only and
kept mapped from push to push, instead of broadcasts; nothing else changes for the engine's loader.
When every member is on the learner's CUDA device, the header may name a CUDA buffer by its IPC handle
instead (`learner.cuda_ipc_bundle`, `kernel.cuda_ipc`): mapped once on this process's index of that
device, the buckets are views of it, on the GPU (not run on a GPU yet).
"""

from __future__ import annotations

import contextlib
import gc
import json
import mmap
import os
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from kernel import cuda_ipc
from rollout_workers.weights import check_state_keys, combine_digest, digest_sample


class WeightGroupError(RuntimeError):
    """A broadcast of the weight group failed or timed out: the sender or another member is gone."""


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
) -> dist.ProcessGroup:
    """Join the `backend` ('gloo' or 'nccl') group at host:port (hosted by learner rank 0) as `rank`;
    every collective on it fails after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend != "gloo":
        raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's buffers live: the current GPU for NCCL, else the CPU."""
    if group.name().lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class WeightGroupMember:
    """This process's place in learner rank 0's weight group; `stream()` reads the next bundle.

    A failed broadcast closes the membership at once (abort, last references dropped): members
    downstream of this one in the collective's tree then fail at once too instead of waiting out
    their timeout, and the group must be joined again."""

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
    ) -> None:
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = open_group(host, port, rank, world_size, timeout_s, backend)
        self.device = group_device(self._group)
        self._mapped: tuple | None = None  # the sender's shared segment or CUDA buffer: (key, key, view)

    def shared(self, path: str, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the shared-memory segment at `path`, mapped read-only (kept while the
        path and size stay the same)."""
        if self._mapped is None or self._mapped[:2] != (path, nbytes):
            self._mapped = None
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as err:
                self.close()  # as after a failed broadcast: the group is joined again
                raise WeightGroupError(
                    f"the learner's shared weight segment {path} cannot be opened here ({err.strerror}): is this "
                    "process on the learner's host? (rollout.weight_transport: broadcast sends over the group)"
                ) from err
            try:
                size = os.fstat(fd).st_size
                if size < nbytes:
                    self.close()
                    raise WeightGroupError(
                        f"the shared weight segment {path} holds {size} bytes, not {nbytes}"
                    )
                buffer = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) if nbytes else b""
            finally:
                os.close(fd)
            with warnings.catch_warnings():  # read-only by design: a receiver only copies out of it
                warnings.simplefilter("ignore", UserWarning)
                view = (
                    torch.frombuffer(buffer, dtype=torch.uint8)
                    if nbytes
                    else torch.empty(0, dtype=torch.uint8)
                )
            self._mapped = (path, nbytes, view)
        return self._mapped[2]

    def ipc(self, description: dict) -> torch.Tensor:
        """The learner's CUDA buffer `description` names (`kernel.cuda_ipc`), mapped (kept while its
        handle stays the same)."""
        key = ("cuda_ipc", description["handle"])
        if self._mapped is None or self._mapped[:2] != key:
            self._mapped = None
            try:
                buffer = cuda_ipc.open_buffer(description)
            except (ValueError, RuntimeError) as err:
                self.close()  # as after a failed broadcast: the group is joined again
                raise WeightGroupError(
                    f"the learner's CUDA weight buffer cannot be opened here ({err}): is this process on the "
                    "learner's device? (rollout.weight_transport: broadcast sends over the group)"
                ) from err
            self._mapped = (*key, buffer)
        return self._mapped[2]

    def stream(self) -> BroadcastStream:
        if self._group is None:
            raise WeightGroupError("this weight group failed earlier: it must be joined again")
        return BroadcastStream(self)

    def receive(self, buffer: torch.Tensor, what: str) -> torch.Tensor:
        """Fill `buffer` (moved to the group's device) from group rank 0's broadcast."""
        buffer = buffer.to(self.device)
        failure = _broadcast_or_failure(self._group, buffer, self.timeout_s)
        if failure is not None:  # outside the except block: no traceback keeps the group alive
            self.close()
            raise WeightGroupError(f"weight broadcast ({what}) failed: {failure}")
        return buffer

    def close(self) -> None:
        group, self._group, self._mapped = self._group, None, None
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.abort()
            del group
            gc.collect()


def _broadcast_or_failure(
    group: dist.ProcessGroup | None, buffer: torch.Tensor, timeout_s: float
) -> str | None:
    """Run one broadcast into `buffer`; None when it completed, else why not."""
    if group is None:
        return "the group was closed"
    try:
        if not group.broadcast([buffer], dist.BroadcastOptions()).wait(timedelta(seconds=timeout_s)):
            return f"not done within {timeout_s:.0f}s"
    except RuntimeError as err:  # gloo/NCCL: the sender or a peer closed, or the wait timed out
        return str(err).splitlines()[0][:300]
    return None


class BroadcastStream:
    """One bundle as it arrives: `version` and `shapes` from the header, then `tensors()`."""

    def __init__(self, member: WeightGroupMember) -> None:
        self._member = member
        length = member.receive(torch.zeros(1, dtype=torch.int64), "header")
        raw = member.receive(torch.empty(int(length.item()), dtype=torch.uint8), "header")
        header = json.loads(bytes(raw.cpu()))
        self.version: int = int(header["version"])
        self._sizes: list[int] = header["sizes"]
        self._entries: list[dict] = header["entries"]
        source = {e["name"]: e for e in self._entries if "same_as" not in e}
        self.shapes: dict[str, tuple[int, ...]] = {
            e["name"]: tuple(source[e.get("same_as", e["name"])]["shape"]) for e in self._entries
        }
        self._next = 0  # the next bucket to receive
        shared = header.get("shared")
        if shared is None:
            self._segment = None
        elif shared.get("kind") == cuda_ipc.KIND:
            self._segment = (member.ipc(shared), shared["offsets"])
        else:
            self._segment = (member.shared(shared["path"], shared["bytes"]), shared["offsets"])
        self._samples: dict[str, tuple[tuple[int, ...], bytes]] = {}

    def _bucket(self) -> torch.Tensor:
        k = self._next
        if self._segment is not None:
            segment, offsets = self._segment
            bucket = segment[offsets[k] : offsets[k] + self._sizes[k]]
        else:
            bucket = self._member.receive(
                torch.empty(self._sizes[k], dtype=torch.uint8), f"bucket {k + 1} of {len(self._sizes)}"
            )
        self._next += 1
        return bucket

    def check(self, expected: Mapping[str, tuple[int, ...]], what: str, min_version: int = 0) -> None:
        """Raise ValueError for a bundle older than `min_version` (versions never go backwards), and
        (naming the keys) when the header's names or shapes do not fit `expected`."""
        if self.version < min_version:
            raise ValueError(f"this engine holds version {min_version}; refusing older {self.version}")
        check_state_keys(
            {k: torch.empty(s, device="meta") for k, s in self.shapes.items()}, expected, what=what
        )

    def tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the sender's order, receiving each bucket when its first tensor is wanted;
        an alias (tied weight) follows its source. The digest sample of every tensor is taken at
        `dtype` as it passes. Tensors are views into their bucket: copy what must outlive the next one."""
        aliases: dict[str, list[str]] = {}
        for e in self._entries:
            if "same_as" in e:
                aliases.setdefault(e["same_as"], []).append(e["name"])
        bucket, index = None, -1
        for e in self._entries:
            if "same_as" in e:
                continue
            while index < e["bucket"]:
                bucket, index = self._bucket(), index + 1
            raw = bucket[e["offset"] : e["offset"] + e["nbytes"]]
            t = raw.view(getattr(torch, e["dtype"])).reshape(e["shape"])
            for name in (e["name"], *aliases.get(e["name"], ())):
                self._samples[name] = (tuple(t.shape), digest_sample(t, dtype))
                yield name, t
        while self._next < len(self._sizes):  # trailing empty buckets
            self._bucket()

    def check_tied(self, groups: list[list[str]]) -> None:
        """Tied names sent as separate tensors must agree (compared on their digest samples; aliases
        are one tensor): the engine holds one tensor for all of them."""
        for names in groups:
            got = {n: self._samples[n] for n in names if n in self._samples}
            if len(set(got.values())) > 1:
                raise ValueError(f"tied weights {sorted(got)} differ in the bundle; they must be equal")

    def digest(self) -> str:
        """`sampled_digest` of the bundle (every tensor must have passed through `tensors()`)."""
        if len(self._samples) != len(self.shapes):
            raise RuntimeError(f"digest of {len(self._samples)} of the bundle's {len(self.shapes)} tensors")
        return combine_digest(self._samples)

    def finish(self) -> None:
        """Receive whatever buckets are left (the group stays in step after a refused or failed load)."""
        while self._next < len(self._sizes):
            self._bucket()

    def __enter__(self) -> BroadcastStream:
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: object) -> None:
        if not isinstance(err, WeightGroupError):
            self.finish()
