"""Weight bundles through CUDA IPC: the collective path's transport when learner rank 0 and every process
of the weight group hold their weights on one CUDA device (`rollout.weight_transport: cuda_ipc`).

The GPU counterpart of `learner.shared_bundle`'s /dev/shm segment, with the same shape: the learner
writes its part of every tensor, cast to the export dtype, straight into one flat CUDA buffer on its
device at the place `learner.weight_broadcast.plan_layout` gives it (`shared_bundle.write_rank_part`:
nothing gathered to the CPU); rank 0 broadcasts only the header over the weight group (gloo: the header
is bytes on the CPU), naming the buffer by its CUDA IPC handle (`kernel.cuda_ipc`); each receiver maps
the buffer and copies its tensors into its engine (`rollout_workers.weight_receiver`), and acknowledges
with the same digests as after any other transport. NCCL cannot do this: it refuses two ranks on one
device.

The buffer is kept from push to push (mapped once by each receiver) and made again only when the
bundle's size changes; receivers have acknowledged the previous version (their copies done) before
the next push writes into it. It lives in rank 0's process: when that process ends the device memory
goes with it (the CUDA driver frees it; an opener's mapping then fails, and the group is formed again).

Not run on a GPU yet: the CPU tests cover the transport's choice and refusals and what runs without a
device (`tests/test_cuda_ipc_transport.py`).
"""

from __future__ import annotations

import secrets

import torch

from kernel.cuda_ipc import describe


class CudaIpcSegment:
    """A flat uint8 CUDA buffer on this process's current device that receivers on the same device map
    (`learner.weight_broadcast.Segment`): `resize(n)` gives its first n bytes (a new buffer only when n
    changes), `describe()` what a receiver opens it by. `path` names it for the driver's bookkeeping
    (`CollectiveWeightSync`): it is no file."""

    def __init__(self, device: torch.device | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "rollout.weight_transport='cuda_ipc': torch.cuda is not available on learner rank 0"
            )
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.path = f"cuda-ipc:{secrets.token_hex(6)}"
        self._buffer: torch.Tensor | None = None
        self._description: dict | None = None

    @classmethod
    def create(cls) -> CudaIpcSegment:
        return cls()

    def resize(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() != nbytes:
            self._buffer = None  # the old one is freed once no receiver maps it (torch's IPC ref counter)
            self._description = None
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    def describe(self) -> dict:
        """The buffer's handle (made once per buffer) with its writes finished (`kernel.cuda_ipc.describe`
        synchronizes the device first, every push)."""
        if self._buffer is None:
            raise RuntimeError("CudaIpcSegment.describe before resize: no buffer yet")
        if self._description is None:
            self._description = describe(self._buffer)
        else:
            torch.cuda.synchronize(self.device)
        return self._description

    def remove(self) -> None:
        """Drop the buffer (receivers' mappings keep it until they drop theirs)."""
        self._buffer, self._description = None, None
