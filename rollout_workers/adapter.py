"""A LoRA adapter applied inside an engine's own model (`rollout.lora_sync: adapter`).

The bundle (the learner's `learner.lora.adapter_bundle`) names modules as the base model does:
`<module>.lora_A` [r, in] and `<module>.lora_B` [out, r] for each adapted linear module, the scale
alpha/r already folded into B, and full tensors under the base model's names for modules trained whole
(`learner.lora.modules_to_save`). The engine keeps its base weights and each adapted module computes
W x + B A x: PEFT's LoRA layers injected into the model in place (`peft.inject_adapter_in_model`, rank
r, alpha r so the scale is 1, no dropout), the same layers the learner trains with. The first load
injects them; every later load must name the same modules and rank, and only copies tensors.

vLLM applies adapters with its own LoRA support, which loads a PEFT folder (`write_peft_folder`).

`held()` reads the adapter back from the layers under the bundle's names, so the acknowledgement's
digest of what the engine holds equals the bundle's after a load, and differs when an adapter was
dropped or an older one kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rollout_workers.weights import listed

ADAPTER = "default"  # PEFT's adapter name inside the engine's model
PARTS = ("lora_A", "lora_B")


def split_bundle(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(`{module: {'lora_A': A, 'lora_B': B}}`, the tensors trained whole) of an adapter bundle; raises
    ValueError for a module with one half only, or a bundle with no adapter at all."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    whole: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf in PARTS:
            pairs.setdefault(module, {})[leaf] = t
        else:
            whole[name] = t
    half = sorted(m for m, p in pairs.items() if len(p) != 2)
    if half:
        raise ValueError(f"adapter bundle: {listed(half)} have lora_A or lora_B but not both")
    if not pairs:
        raise ValueError(
            "adapter bundle holds no '<module>.lora_A' / '<module>.lora_B' tensors: a full weight bundle? "
            "(rollout.lora_sync='adapter' loads the learner's adapter export; 'merged' loads full weights)"
        )
    return pairs, whole


def bundle_rank(pairs: dict[str, dict[str, torch.Tensor]]) -> int:
    """The rank r of a checked bundle's adapter (its lora_A tensors are [r, in])."""
    return int(next(iter(pairs.values()))["lora_A"].shape[0])


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear module (`nn.Linear`, transformers' `Conv1D` stored [in, out], or a
    LoRA layer around one); None for any other module."""
    from transformers.pytorch_utils import Conv1D

    module = getattr(module, "base_layer", module)
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return tuple(module.weight.shape)
    return None


def check_bundle(
    model: nn.Module, state: dict[str, torch.Tensor], modules: list[str], rank: int
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The bundle split (`split_bundle`) after checking it fits `model` (a meta-device skeleton will do)
    and, once an adapter was loaded (`modules` non-empty), has its modules and `rank`; ValueError
    naming the keys otherwise."""
    pairs, whole = split_bundle(state)
    ranks = sorted({int(p["lora_A"].shape[0]) for p in pairs.values()})
    if len(ranks) != 1:
        raise ValueError(f"adapter bundle: its lora_A tensors have different ranks {ranks}")
    r = ranks[0]
    named = dict(model.named_modules())
    missing = sorted(m for m in pairs if m not in named)
    if missing:
        raise ValueError(f"adapter bundle names modules the model does not have: {listed(missing)}")
    not_linear = sorted(m for m in pairs if linear_shape(named[m]) is None)
    if not_linear:
        raise ValueError(f"adapter bundle adapts modules that are not linear: {listed(not_linear)}")
    bad = []
    for m, p in sorted(pairs.items()):
        fan_in, fan_out = linear_shape(named[m])
        want = {"lora_A": (r, fan_in), "lora_B": (fan_out, r)}
        bad += [f"{m}.{k}: {tuple(p[k].shape)} != {want[k]}" for k in PARTS if tuple(p[k].shape) != want[k]]
    if bad:
        raise ValueError(f"adapter bundle: shapes do not fit the model: {listed(bad)}")
    if modules and (sorted(pairs) != modules or r != rank):
        raise ValueError(
            f"adapter bundle: rank {r} on {len(pairs)} modules, but this engine's adapter has rank "
            f"{rank} on {len(modules)} modules (an adapter's shape is fixed for a run)"
        )
    own = model.state_dict()
    unknown = sorted(n for n in whole if n not in own)
    if unknown:
        raise ValueError(f"adapter bundle holds tensors the model does not have: {listed(unknown)}")
    bad = [
        f"{n}: {tuple(t.shape)} != {tuple(own[n].shape)}" for n, t in whole.items() if t.shape != own[n].shape
    ]
    if bad:
        raise ValueError(f"adapter bundle: shapes do not fit the model: {listed(bad)}")
    return pairs, whole


def write_peft_folder(
    path: Path, pairs: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype, base: str
) -> None:
    """The adapter of `pairs` (scale folded into B) as a PEFT folder, the format vLLM's LoRA loads:
    `adapter_config.json` (rank r, alpha r: scale 1) and `adapter_model.safetensors` with PEFT's keys
    (`base_model.model.<module>.lora_A.weight`)."""
    from safetensors.torch import save_file

    rank = bundle_rank(pairs)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({m.rpartition(".")[2] for m in pairs}),
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
    }
    tensors = {
        f"base_model.model.{m}.{part}.weight": p[part].detach().to("cpu", dtype).contiguous()
        for m, p in pairs.items()
        for part in PARTS
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config, indent=1))


class AdapterSlots:
    """The adapter layers of one engine's model: injected at the first load, filled at every load."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.modules: list[str] = []  # adapted modules, once injected
        self.rank = 0
        self.whole: list[str] = []  # names of the tensors trained whole, as the last load gave them

    def check(
        self, state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """The bundle split (`split_bundle`) after checking it fits the model (`check_bundle`)."""
        return check_bundle(self.model, state, self.modules, self.rank)

    @torch.no_grad()
    def load(self, pairs: dict[str, dict[str, torch.Tensor]], whole: dict[str, torch.Tensor]) -> None:
        """Inject the layers (first load) and copy the checked bundle into them."""
        if not self.modules:
            self._inject(sorted(pairs), bundle_rank(pairs))
        for m, p in pairs.items():
            layer = self.model.get_submodule(m)
            for part in PARTS:
                getattr(layer, part)[ADAPTER].weight.copy_(p[part])
        own = self.model.state_dict()
        for name, t in whole.items():
            own[name].copy_(t)
        self.whole = sorted(whole)

    def _inject(self, modules: list[str], rank: int) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=modules, lora_dropout=0.0, bias="none")
        inject_adapter_in_model(config, self.model, adapter_name=ADAPTER)
        device = next(self.model.parameters()).device
        for m in modules:
            layer = self.model.get_submodule(m)
            if not isinstance(layer, LoraLayer):  # PEFT matches names by suffix: it must have taken each
                raise RuntimeError(f"PEFT did not adapt {m!r}")
            for part in PARTS:
                getattr(layer, part).to(device=device, dtype=self.dtype)
        self.model.requires_grad_(False)
        self.model.eval()
        self.modules, self.rank = modules, rank

    def held(self) -> dict[str, torch.Tensor]:
        """The adapter as the layers hold it, under the bundle's names (empty before the first load)."""
        out = {}
        for m in self.modules:
            layer = self.model.get_submodule(m)
            for part in PARTS:
                out[f"{m}.{part}"] = getattr(layer, part)[ADAPTER].weight
        own = self.model.state_dict()
        out.update({n: own[n] for n in self.whole})
        return out
