"""learner.shared_bundle: each rank's part written into a shared-memory segment adds up to the bundle.

The ZeRO-3 side (partitions read where DeepSpeed keeps them) runs on real ranks in
tests/test_learner_ranks.py; here the full-tensor split, the layout the receivers read, and the
segment's life."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from learner.shared_bundle import (
    PREFIX,
    SharedSegment,
    export_layout,
    remove_orphans,
    segment_views,
    write_rank_part,
)
from learner.weight_broadcast import state_layout


def _state() -> dict[str, torch.Tensor]:
    """Odd sizes (the last rank's share is short, or empty), a tied pair, an integer buffer."""
    g = torch.Generator().manual_seed(0)
    tied = torch.nn.Parameter(torch.randn(7, 5, generator=g))
    return {
        "embed.weight": tied,
        "layer.weight": torch.nn.Parameter(torch.randn(3, 11, generator=g)),
        "layer.bias": torch.nn.Parameter(torch.randn(1, generator=g)),  # fewer elements than ranks
        "positions": torch.arange(13, dtype=torch.int64),
        "head.weight": tied,
    }


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_ranks_parts_add_up_to_the_bundle_in_the_receivers_layout(tmp_path, world, dtype):
    state = _state()
    layout = export_layout(state, bucket_bytes=96, dtype=dtype)
    bundle = {
        k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype)
        for k, v in state.items()
    }
    bundle["head.weight"] = bundle["embed.weight"]
    # the layout planned from the model is the one the broadcast plans from the bundle itself
    assert layout == state_layout(bundle, bucket_bytes=96)
    assert len(layout.sizes) > 1 and [e.get("same_as") for e in layout.entries][-1] == "embed.weight"

    segment = SharedSegment.create(str(tmp_path))
    flat = segment.resize(layout.segment_bytes())
    flat.fill_(0xFF)  # whatever a rank does not write stays visible
    written = sum(write_rank_part(state, layout, flat, rank, world) for rank in range(world))
    assert written == sum(v.numel() for k, v in state.items() if k != "head.weight")

    views = segment_views(
        layout, SharedSegment(segment.path).resize(layout.segment_bytes())
    )  # another mapping
    assert list(views) == list(state)
    for k, t in bundle.items():
        assert views[k].dtype == t.dtype and torch.equal(views[k], t), k
    assert views["head.weight"] is views["embed.weight"]
    segment.remove()


def test_a_rank_writes_only_its_own_share(tmp_path):
    state = {"w": torch.arange(10, dtype=torch.float32)}
    layout = export_layout(state, 1 << 20, None)
    flat = SharedSegment.create(str(tmp_path)).resize(layout.segment_bytes())
    flat.zero_()
    write_rank_part(state, layout, flat, 1, 3)  # ceil(10 / 3) = 4 elements a rank: rank 1 has 4..7
    assert segment_views(layout, flat)["w"].tolist() == [0, 0, 0, 0, 4, 5, 6, 7, 0, 0]


def test_the_owner_removes_its_segment_and_a_dead_owners_is_swept(tmp_path):
    segment = SharedSegment.create(str(tmp_path))
    assert os.path.basename(segment.path).startswith(f"{PREFIX}{os.getpid()}-")
    segment.resize(64).fill_(7)
    reader = SharedSegment(segment.path)  # not the owner: dropping it removes nothing
    assert reader.resize(64).sum().item() == 7 * 64
    del reader
    assert os.path.exists(segment.path)
    path = segment.path
    del segment  # the owner's segment goes with it
    assert not os.path.exists(path)

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    orphan = tmp_path / f"{PREFIX}{int(gone.stdout)}-abc"
    orphan.write_bytes(b"x")
    alive = SharedSegment.create(str(tmp_path))  # making one sweeps the segments of dead owners
    assert not orphan.exists() and os.path.exists(alive.path)
    assert remove_orphans(str(tmp_path)) == []  # a living owner's stays
    alive.remove()
    assert not os.path.exists(alive.path)


OWNER = """
import sys
from learner.shared_bundle import SharedSegment
segment = SharedSegment.create(sys.argv[1])
segment.resize(1 << 16).fill_(1)
print(segment.path, flush=True)
sys.stdin.readline()  # until the test ends it
"""


def _wait_gone(path: str, timeout_s: float = 60.0) -> bool:
    """Whether `path` is removed within `timeout_s` (the watcher's unlink is the event waited on)."""
    deadline = time.monotonic() + timeout_s
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_segment_goes_when_its_owner_is_killed(tmp_path):
    """SIGKILL runs no finaliser: the owner's watcher process removes the segment, no new segment needed."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        path = owner.stdout.readline().strip()
        assert os.path.getsize(path) == 1 << 16 and remove_orphans(str(tmp_path)) == []  # alive: kept
    finally:
        owner.kill()  # SIGKILL
        owner.wait()
    assert _wait_gone(path), f"{path} outlived its SIGKILLed owner"


def test_a_killed_learner_actors_segment_goes(ray_local, tmp_path):
    """The same with the owner a Ray actor killed with SIGKILL: Ray's clean-up of the dead worker's process
    group does not take the watcher (its own session) before it has removed the segment."""
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Owner:
        def make(self, directory: str) -> tuple[str, int]:
            self.segment = SharedSegment.create(directory)
            self.segment.resize(1 << 16).fill_(1)
            return self.segment.path, os.getpid()

    actor = Owner.remote()
    path, pid = ray.get(actor.make.remote(str(tmp_path)), timeout=120)
    assert os.path.exists(path)
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(path), f"{path} outlived its SIGKILLed Ray actor"
    ray.kill(actor)


LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_live_owner_whose_pid_is_not_alive_here_keeps_its_segment(tmp_path):
    """An owner in another PID namespace (`docker --ipc=host`): the pid in the name is dead here, but the
    owner is alive and holds the segment's lock: the sweep keeps it; once the owner is gone, it is swept."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    path = tmp_path / f"{PREFIX}{int(dead.stdout)}-otherns"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert remove_orphans(str(tmp_path)) == []
        mine = SharedSegment.create(str(tmp_path))  # making one sweeps too
        assert path.exists()
        mine.remove()
    finally:
        holder.stdin.close()  # the owner ends: the kernel lets go of its lock
        holder.wait()
    assert remove_orphans(str(tmp_path)) == [str(path)] and not path.exists()
