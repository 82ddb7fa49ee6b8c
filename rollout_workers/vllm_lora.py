"""The LoRA adapter a vLLM engine holds (`rollout.lora_sync: adapter`): its folder, its request, its shape.

vLLM loads an adapter from a PEFT folder named by a `LoRARequest` (name, integer id, path); it keeps
adapters in a cache keyed by the id, and keys its prefix cache by the adapter too. Reusing an id
after changing the folder's files silently keeps the older weights (unless `load_inplace`, which still
reuses the older prefix-cache blocks), so every pushed adapter gets a new id, name and folder, and the
older one is removed. The folders live in a private temporary directory (in /dev/shm where there is
one: no disk write), deleted with the engine.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from rollout_workers.adapter import bundle_rank, check_bundle, write_peft_folder

# The ranks vLLM reserves LoRA buffers for (vllm.config.lora.MaxLoRARanks in vLLM 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_room(rank: int | None) -> int:
    """vLLM's `max_lora_rank` for adapters of `rank`: the smallest size it accepts that holds them."""
    if rank is None:
        raise ValueError(
            "rollout.vllm.max_lora_rank is unset: the cluster sets it from learner.lora.rank; set it when "
            "building a vLLM engine for adapters by hand"
        )
    room = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not room:
        raise ValueError(f"LoRA rank {rank} is above the largest vLLM supports ({VLLM_LORA_RANKS[-1]})")
    return room[0]


class LoRASlot:
    """The one adapter a vLLM engine applies: the request naming it, and the modules and rank it has."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.request: Any = None  # vLLM's LoRARequest of the adapter held (None: the base model)
        self.modules: list[str] = []
        self.rank = 0
        self._next_id = 1
        self._dir: Path | None = None

    def prepare(
        self, skeleton: Any, state: dict[str, torch.Tensor], dtype: torch.dtype, base: str
    ) -> tuple[Any, dict[str, dict[str, torch.Tensor]]]:
        """Check an adapter bundle against the model (`skeleton`, meta tensors) and the adapter held, write
        it as a PEFT folder of its own; the new request naming it, and the bundle's pairs."""
        if not self.enabled:
            raise NotImplementedError(
                "this vLLM engine was built without LoRA support: rollout.lora_sync='adapter' builds it with it"
            )
        pairs, whole = check_bundle(skeleton, state, self.modules, self.rank)
        if whole:
            raise ValueError(
                f"vLLM's LoRA applies lora_A / lora_B only, and the adapter bundle also holds modules trained "
                f"whole ({sorted(whole)[:4]}): learner.lora.modules_to_save needs rollout.lora_sync='merged' "
                "with the vLLM engine"
            )
        return self._write(pairs, dtype, base), pairs

    def _write(self, pairs: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype, base: str) -> Any:
        """The adapter written as a PEFT folder of its own, and the new request naming it."""
        if self._dir is None:
            shm = Path("/dev/shm")
            self._dir = Path(tempfile.mkdtemp(prefix="rayppo-lora-", dir=shm if shm.is_dir() else None))
            weakref.finalize(self, shutil.rmtree, str(self._dir), True)
        ident, self._next_id = self._next_id, self._next_id + 1
        folder = self._dir / f"adapter-{ident}"
        write_peft_folder(folder, pairs, dtype, base)
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"rayppo-adapter-{ident}", ident, str(folder))

    def use(self, request: Any, pairs: dict[str, dict[str, torch.Tensor]]) -> Any:
        """Make `request` (added to vLLM) the one every request names; returns the one it replaces."""
        previous, self.request = self.request, request
        self.modules = sorted(pairs)
        self.rank = bundle_rank(pairs)
        return previous

    def remove(self, request: Any) -> None:
        """Delete a replaced adapter's folder."""
        shutil.rmtree(request.lora_path, ignore_errors=True)
