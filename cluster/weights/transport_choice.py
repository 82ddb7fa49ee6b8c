"""Which way a collective weight push travels (`rollout.weight_transport`), from where the group's
members are: one rule, pure, tested on placement descriptions (`tests/test_cuda_ipc_transport.py`).

- 'broadcast': every byte over the group (gloo, or NCCL between GPUs), always possible.
- 'shared_memory': every learner rank and worker on one node with CPU weights (a gloo group), and the
  node's /dev/shm has room for the bundle (`learner.shared_bundle`).
- 'cuda_ipc': learner ranks and workers with GPU weights (the group's backend would be NCCL), every
  one on one node and on the same CUDA device, torch.cuda available in each (`learner.cuda_ipc_bundle`). The group then runs on gloo (it carries the header
  only): NCCL refuses two ranks on one device, the very case this transport is for.
- 'auto': cuda_ipc where it applies, else shared_memory where it applies, else broadcast.

Asked explicitly where it cannot apply, a transport is refused (`TransportRefused`, naming
`rollout.weight_transport` and the reason) when the group first forms, at the first weight push (the
config refuses 'cuda_ipc' for CPU workers before Ray starts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class TransportRefused(ValueError):
    """The transport asked for cannot carry this group's pushes; the message names the field and why."""


@dataclass(frozen=True)
class MemberPlace:
    """Where one member of the weight group (a learner rank, or a process holding an engine's weights)
    runs: its Ray node, and the UUID of the CUDA device it works on (None: torch.cuda not available
    there)."""

    name: str
    node: str
    cuda_device: str | None


@dataclass(frozen=True)
class TransportChoice:
    """The transport chosen and the group's backend under it."""

    transport: str  # broadcast | shared_memory | cuda_ipc
    backend: str  # gloo | nccl


def cuda_ipc_obstacle(places: list[MemberPlace], backend: str) -> str | None:
    """Why CUDA IPC cannot carry pushes among `places`, whose weights would travel on a `backend` group
    (gloo: learner or workers hold CPU weights), or None when it can."""
    if backend != "nccl":
        return (
            "the learner's or the workers' weights are on the CPU (learner.num_gpus_per_rank or "
            "rollout.num_gpus_per_worker is 0)"
        )
    no_cuda = [p.name for p in places if p.cuda_device is None]
    if no_cuda:
        return f"torch.cuda is not available in {', '.join(no_cuda)}"
    nodes = {p.node for p in places}
    if len(nodes) > 1:
        return f"the learner ranks and workers are on {len(nodes)} nodes, not one"
    devices = {p.cuda_device for p in places}
    if len(devices) > 1:
        return f"the learner ranks and workers are on {len(devices)} CUDA devices, not one"
    return None


def shared_memory_obstacle(places: list[MemberPlace], backend: str) -> str | None:
    """Why a /dev/shm segment cannot carry pushes among `places` on a `backend` group (room aside)."""
    nodes = {p.node for p in places}
    if len(nodes) > 1 or backend != "gloo":
        return f"they are on {len(nodes)} nodes, backend {backend}"
    return None


def choose_transport(
    asked: str, places: list[MemberPlace], backend: str, room: Callable[[], tuple[int, int]]
) -> TransportChoice:
    """The transport for `asked` ('auto', 'broadcast', 'shared_memory' or 'cuda_ipc') among `places`,
    whose group would run on `backend`; `room()` gives (bytes the bundle needs, bytes free in /dev/shm),
    asked only where shared memory is in question. Raises `TransportRefused` for an explicit transport
    that cannot apply."""
    if asked == "broadcast":
        return TransportChoice("broadcast", backend)
    if asked in ("cuda_ipc", "auto"):
        why = cuda_ipc_obstacle(places, backend)
        if why is None:
            return TransportChoice("cuda_ipc", "gloo")
        if asked == "cuda_ipc":
            raise TransportRefused(
                f"rollout.weight_transport='cuda_ipc' needs every learner rank and rollout worker on one node and "
                f"one CUDA device: {why}; use 'auto' or 'broadcast'"
            )
    if asked in ("shared_memory", "auto"):
        why = shared_memory_obstacle(places, backend)
        if why is not None:
            if asked == "shared_memory":
                raise TransportRefused(
                    "rollout.weight_transport='shared_memory' needs every learner rank and rollout worker on one "
                    f"node with CPU weights (gloo); {why}: use 'auto' or 'broadcast'"
                )
            return TransportChoice("broadcast", backend)
        need, free = room()
        if need <= free:
            return TransportChoice("shared_memory", backend)
        if asked == "shared_memory":
            raise TransportRefused(
                f"rollout.weight_transport='shared_memory': the bundle needs {need / 2**20:.0f} MiB in the node's "
                f"/dev/shm and {free / 2**20:.0f} MiB are free: give it more (docker run --shm-size) or use "
                "'auto' or 'broadcast'"
            )
        return TransportChoice("broadcast", backend)
    raise ValueError(
        f"rollout.weight_transport must be one of auto, broadcast, shared_memory, cuda_ipc; got {asked!r}"
    )
