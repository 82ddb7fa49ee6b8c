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

The segment is kept from push to push (its pages are faulted in once). Learner rank 0 owns it, and it
never outlives its owner, however the owner ends (`Owner`): the owner removes it when it is dropped,
closed or the process exits; a small watcher process the owner starts (in a session of its own, out of
reach of a kill of the owner's process group) removes it when the owner is gone, a SIGKILL or an OOM
kill included; and the owner holds an exclusive `flock` on the file for its life, which the kernel
releases when the owner dies, so a segment nobody holds the lock of is an orphan, removed when a new
one is made (`remove_orphans`). The lock, not the pid in the file name (kept for people), says whether
the owner lives: a pid means nothing in another PID namespace (`docker --ipc=host`, Kubernetes
`hostIPC` share /dev/shm, not pids), where a dead-looking pid can be another run's live owner. (A
process forked from the owner without exec inherits the lock and the watcher's pipe: the segment then
lives until that child ends too.)
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import subprocess
import sys
import weakref
from dataclasses import dataclass
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


def _names_file(fd: int, path: str | Path) -> bool:
    """Whether `path` still names the file open as `fd` (not removed, not replaced)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_orphans(directory: str) -> list[str]:
    """Remove the segments in `directory` whose owner is gone: no process holds their lock (in any PID
    namespace); returns their paths. Another user's segment, which this process cannot open, stays."""
    gone = []
    for path in Path(directory).glob(f"{PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, PermissionError):  # removed meanwhile, or not ours to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner holds it: alive
            os.close(fd)
            continue
        try:  # ours now: an owner that just made it waits for this lock, then finds its name gone
            if _names_file(fd, path):
                _unlink(str(path))
                gone.append(str(path))
        finally:
            os.close(fd)
    return gone


# The watcher: waits for the end of its stdin, a pipe only the owner holds the other end of (the owner
# closes it, or the kernel does when the owner dies), then removes the segment.
_WATCHER = (
    "import os,sys\nsys.stdin.buffer.read()\ntry: os.unlink(sys.argv[1])\nexcept FileNotFoundError: pass\n"
)


@dataclass
class Owner:
    """What keeps a segment tied to its owner's life: the file open with its `flock` held, and the
    write end of the pipe its watcher process reads."""

    lock_fd: int
    pipe_fd: int
    watcher: subprocess.Popen

    @classmethod
    def take(cls, path: str, lock_fd: int) -> Owner:
        """Start the watcher of `path`, whose lock `lock_fd` holds."""
        read, write = os.pipe()
        try:
            watcher = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHER, path],
                stdin=read,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # not in the owner's process group, which Ray kills with a worker
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        return cls(lock_fd, write, watcher)


def _release(path: str, owner: Owner) -> None:
    """The owner's end: the file removed, its lock let go, the watcher told (it exits at once)."""
    _unlink(path)
    os.close(owner.lock_fd)
    os.close(owner.pipe_fd)
    owner.watcher.wait()


class SharedSegment:
    """A file under /dev/shm mapped read-write: `resize(n)` gives its first n bytes as a flat uint8
    tensor (mapped again only when n changes). `create` makes a new one owned by this process (removed
    when the object is dropped or the process ends, however: see the module docstring);
    `SharedSegment(path)` opens an existing one."""

    def __init__(self, path: str, owner: Owner | None = None) -> None:
        self.path = str(path)
        self._size = -1
        self._tensor: torch.Tensor | None = None
        self._finalizer = weakref.finalize(self, _release, self.path, owner) if owner is not None else None

    @classmethod
    def create(cls, directory: str = DEFAULT_DIR) -> SharedSegment:
        remove_orphans(directory)
        while True:
            path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for the segment's life; waits out a sweep that took it
            if _names_file(fd, path):
                break
            os.close(fd)  # swept between its making and the lock: another name
        try:
            return cls(path, owner=Owner.take(path, fd))
        except BaseException:
            _unlink(path)
            os.close(fd)
            raise

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
