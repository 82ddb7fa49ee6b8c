"""LoRA on the policy (`learner.lora`): PEFT adapters injected into the HF model, merged for export.

`apply_lora` injects PEFT's LoRA layers into the HF causal LM in place (the model keeps its own
class, so every type-based path of kernel.sequences still applies) and freezes everything else:
only `lora_A` / `lora_B` (and `modules_to_save` copies) train. Parameter names change the way PEFT
changes them: a targeted `<module>.weight` becomes `<module>.base_layer.weight`, with
`<module>.lora_A.default.weight` [r, in] and `<module>.lora_B.default.weight` [out, r] beside it.

Exports are merged: `merged_cpu_state_dict` streams the model bucket by bucket (ZeRO-3 gathers each
bucket, as learner.gather does) and writes each targeted weight as `merge_weight(W, A, B, s)` under
the base model's own name, so engines load full weights exactly as without LoRA and their digest /
probe acknowledgement sees the adapter. `adapter_bundle` is the adapter alone as the engines take it
(`rollout.lora_sync: adapter`); `adapter_state` and `save_adapter` write it in PEFT's format
(`adapter_config.json`, `adapter_model.safetensors`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from learner.config import LoRAConfig
from learner.gather import buckets, cpu_state_dict, gathered, group_tied

ADAPTER = "default"  # PEFT's adapter name; the only one trained here
FIELD = "learner.lora.target_modules"


def linear_module_names(model: nn.Module) -> list[str]:
    """Full names of the modules LoRA can target: `nn.Linear` and transformers' `Conv1D` (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return [n for n, m in model.named_modules() if n and isinstance(m, nn.Linear | Conv1D)]


def matches(module: str, key: str) -> bool:
    """PEFT's rule for a target name: the full module name, or its trailing dotted components."""
    return module == key or module.endswith("." + key)


def tied_module_names(model: nn.Module) -> set[str]:
    """Modules owning a parameter shared with another module (e.g. a tied `lm_head` and `wte`)."""
    owners: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(name.rpartition(".")[0])
    return {m for names in owners.values() if len(names) > 1 for m in names}


def check_targets(model: nn.Module, cfg: LoRAConfig) -> None:
    """Raise ValueError naming the field for target or saved modules the model lacks, a target that is
    not linear, and a tied module (its merged or retrained copy would untie it)."""
    linear = linear_module_names(model)
    short = sorted({n.rpartition(".")[2] for n in linear})
    tied = tied_module_names(model)
    if isinstance(cfg.target_modules, list):
        missing = [k for k in cfg.target_modules if not any(matches(n, k) for n in linear)]
        if missing:
            raise ValueError(
                f"{FIELD}: {missing} match no linear module of the model; its linear modules are {short} "
                f"(full names such as {linear[:3]}), or use 'all-linear'"
            )
        bad = sorted(n for n in linear if n in tied and any(matches(n, k) for k in cfg.target_modules))
        if bad:
            raise ValueError(f"{FIELD}: {bad} share their weight with another module (tied embeddings)")
    modules = [n for n, _ in model.named_modules() if n]
    missing = [k for k in cfg.modules_to_save if not any(matches(n, k) for n in modules)]
    if missing:
        raise ValueError(f"learner.lora.modules_to_save: {missing} match no module of the model")
    bad = sorted(n for n in tied if any(matches(n, k) for k in cfg.modules_to_save))
    if bad:
        raise ValueError(f"learner.lora.modules_to_save: {bad} share their weight with another module")
    params = [n for n, _ in model.named_parameters()]
    missing = [k for k in cfg.target_parameters if not any(matches(n, k) for n in params)]
    if missing:
        stacks = sorted({".".join(n.split(".")[-2:]) for n in expert_stacks(model)})
        raise ValueError(
            f"learner.lora.target_parameters: {missing} match no parameter of the model; its 3-D (fused "
            f"expert) parameters are {stacks or 'none'}"
        )
    if cfg.target_parameters and cfg.dropout:
        raise ValueError(
            f"learner.lora.dropout={cfg.dropout}: PEFT's adapters on parameters (learner.lora.target_parameters) "
            "take no dropout; set it to 0"
        )


def expert_stacks(model: nn.Module) -> list[str]:
    """Full names of the 3-D parameters of `model`: the fused expert stacks of a mixture of experts
    (transformers' `*Experts` modules: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])."""
    return [n for n, p in model.named_parameters() if p.ndim == 3]


def peft_config(cfg: LoRAConfig):
    """The `peft.LoraConfig` of `cfg` (scale alpha/r: no rsLoRA, no DoRA)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        target_parameters=list(cfg.target_parameters) or None,
        modules_to_save=list(cfg.modules_to_save) or None,
        bias="none",
    )


def apply_lora(policy: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Inject LoRA adapters into `policy` in place (checked first: `check_targets`) and return it, every
    other parameter frozen. `cfg.rank` must be > 0."""
    from peft import get_peft_model

    if cfg.rank <= 0:
        raise ValueError(f"learner.lora.rank={cfg.rank}: LoRA is off")
    check_targets(policy, cfg)
    wrapped = get_peft_model(policy, peft_config(cfg))
    return wrapped.base_model.model  # the same model object, its layers now PEFT's


@dataclass(frozen=True)
class LoraLayerInfo:
    """One adapted layer: its module name, scale alpha/r, weight layout (GPT-2's Conv1D is [in, out]), the
    state name of the weight its adapter adds to (`<name>.base_layer.weight` for a module; for a parameter
    PEFT wraps (`target_parameters`), under as many `.base_layer` as wrappers are nested), and for a 3-D
    expert stack its number of experts (0: a 2-D weight) and whether it is stored [E, out, in]."""

    name: str
    scale: float
    fan_in_fan_out: bool
    base: str = ""
    experts: int = 0
    out_in: bool = True


def _layer_info(name: str, layer) -> LoraLayerInfo:
    from peft.tuners.lora import ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    path, inner = name, layer
    while isinstance(inner, BaseTunerLayer):  # nested wrappers: one per targeted parameter of a module
        path, inner = f"{path}.base_layer", inner.base_layer
    wrapped = isinstance(layer, ParamWrapper)
    base = f"{path}.{layer.parameter_name if wrapped else 'weight'}"
    experts = layer.num_experts if wrapped and layer._param_ndim == 3 else 0
    out_in = bool(getattr(layer, "_did_swap_in_out_features", True))
    return LoraLayerInfo(
        name,
        float(layer.scaling[ADAPTER]),
        bool(getattr(layer, "fan_in_fan_out", False)),
        base,
        experts,
        out_in,
    )


def lora_layers(model: nn.Module) -> list[LoraLayerInfo]:
    """The adapted layers of `model` (none without LoRA). A LoRA layer exists only once PEFT is imported,
    so a run without `learner.lora` neither imports nor needs it."""
    if sys.modules.get("peft") is None:  # never imported (or blocked)
        return []
    from peft.tuners.lora import LoraLayer

    return [
        _layer_info(n, m)
        for n, m in model.named_modules()
        if isinstance(m, LoraLayer) and ADAPTER in m.lora_A
    ]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Inside, `model` computes its base weights alone: every LoRA layer skips its adapter and every
    `modules_to_save` copy gives way to the original module (PEFT's own `enable_adapters`, as
    `PeftModel.disable_adapter` does; it also clears and then restores the adapters' requires_grad).
    The frozen reference of a LoRA run whose reference is the initial policy (learner.reference_from_base)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    toggled = [m for m in model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]
    if not toggled:
        raise ValueError("the model has no LoRA adapters to turn off (learner.lora.rank is 0)")
    for m in toggled:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in toggled:
            m.enable_adapters(True)


def merge_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool = False
) -> torch.Tensor:
    """The merged weight W' = W + (B @ A) * scale, scale = alpha / r; transposed, W + (B @ A)^T * scale,
    where the base stores [in, out] (`fan_in_fan_out`, GPT-2's Conv1D). A is [r, in], B is [out, r].
    Computed in float32 and returned in the base's dtype."""
    delta = (b.float() @ a.float()) * scale
    if fan_in_fan_out:
        delta = delta.T
    return (base.float() + delta).to(base.dtype)


def merge_expert_weight(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out_in: bool = True
) -> torch.Tensor:
    """The merged expert stack W'_e = W_e + (B_e @ A_e) * scale for each expert e of a 3-D `base` [E, out, in]
    (transformers' fused experts; `out_in` False: [E, in, out], each delta transposed), in PEFT's
    ParamWrapper layout: A is [E r, in] with expert e's rows at e r .. e r + r - 1 (A_e = A.view(E, r, in)[e]),
    B is [out, r E] with expert e's columns at e, E + e, 2E + e, ... (B_e = B.view(out, r, E)[:, :, e]).
    Computed in float32 and returned in the base's dtype."""
    experts = base.shape[0]
    a_e = a.float().reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b_e = b.float().reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
    delta = torch.bmm(b_e, a_e) * scale  # [E, out, in]
    if not out_in:
        delta = delta.transpose(1, 2)
    return (base.float() + delta).to(base.dtype)


def _merged(full: torch.Tensor, a: torch.Tensor, b: torch.Tensor, info: LoraLayerInfo) -> torch.Tensor:
    if info.experts:
        return merge_expert_weight(full, a, b, info.scale, info.out_in)
    return merge_weight(full, a, b, info.scale, info.fan_in_fan_out)


def hf_name(name: str) -> str | None:
    """The base model's name of a LoRA model's state entry; None for entries the export drops (the
    adapter tensors, merged into their base weight, and a modules_to_save module's frozen original).
    Nested wrappers (several parameters of one module targeted) leave one `.base_layer` each."""
    if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name or ".original_module." in name:
        return None
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name.replace(f".modules_to_save.{ADAPTER}.", ".")


@dataclass(frozen=True)
class ExportEntry:
    """One exported tensor: its base-model names (tied names share it), its source tensor, and the
    adapter merged into it (None: copied as it is)."""

    names: list[str]
    tensor: torch.Tensor
    lora: tuple[torch.Tensor, torch.Tensor, LoraLayerInfo] | None


def export_entries(state: dict[str, torch.Tensor], layers: list[LoraLayerInfo]) -> list[ExportEntry]:
    """The entries of a LoRA model's `state_dict(keep_vars=True)`, in its order, tied tensors once."""
    by_base = {layer.base: layer for layer in layers}
    kept = {n: t for n, t in state.items() if hf_name(n) is not None}
    out = []
    for names, t in group_tied(kept):
        layer = by_base.get(names[0])
        lora = None
        if layer is not None:
            lora = (
                state[f"{layer.name}.lora_A.{ADAPTER}.weight"],
                state[f"{layer.name}.lora_B.{ADAPTER}.weight"],
                layer,
            )
        out.append(ExportEntry([hf_name(n) for n in names], t, lora))
    return out


def merged_cpu_state_dict(
    model: nn.Module, bucket_bytes: int, keep: bool, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """`learner.gather.cpu_state_dict` of the merged model: the base model's names and tensors with every
    adapter merged in (`merge_weight`), bucket by bucket (ZeRO-3 gathers a bucket's weights and their
    adapters together), floating tensors cast to `dtype` after the merge; None where `keep` is False.
    A model without LoRA gives its own state."""
    state = model.state_dict(keep_vars=True)
    layers = lora_layers(model)
    if not layers:
        return cpu_state_dict(state, bucket_bytes, keep, dtype)
    zero3 = any(hasattr(t, "ds_id") for t in state.values())
    if not keep and not zero3:
        return None
    copies: dict[str, torch.Tensor] = {}
    entries = export_entries(state, layers)
    for bucket in buckets([(e, e.tensor) for e in entries], bucket_bytes):
        tensors = [t for e, _ in bucket for t in (e.tensor, *(e.lora[:2] if e.lora else ()))]
        with gathered(tensors):
            if not keep:
                continue
            for e, t in bucket:
                full = t.detach()
                if e.lora is not None:
                    a, b, info = e.lora
                    full = _merged(full, a.detach(), b.detach(), info)
                cast = dtype if dtype is not None and full.is_floating_point() else full.dtype
                copy = full.to("cpu", dtype=cast, copy=True).contiguous()
                for name in e.names:
                    copies[name] = copy
    order = [hf_name(n) for n in state if hf_name(n) is not None]
    return {name: copies[name] for name in order} if keep else None


def adapter_bundle(
    model: nn.Module, bucket_bytes: int, keep: bool, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """The adapter alone, as an engine applies it (`rollout.lora_sync: adapter`): for each adapted module
    `<module>.lora_A` [r, in] and `<module>.lora_B` [out, r] with the scale alpha/r folded into B (so
    the engine's layer computes W x + B A x whatever alpha was: `rollout_workers.adapter`), and every
    `modules_to_save` copy under the base model's names. Module names are the base model's (no PEFT
    prefix). CPU copies gathered bucket by bucket (ZeRO-3), floating tensors cast to `dtype` after the
    scale; None where `keep` is False."""
    layers = {layer.name: layer for layer in lora_layers(model)}
    if not layers:
        raise ValueError("the policy has no LoRA adapters to export (learner.lora.rank is 0)")
    stacked = sorted(n for n, layer in layers.items() if layer.experts)
    if stacked:
        raise ValueError(
            f"rollout.lora_sync='adapter' carries per-module adapters only, but {stacked[:2]} adapt fused expert "
            "stacks (learner.lora.target_parameters): set rollout.lora_sync='merged'"
        )
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    state = cpu_state_dict(trainable, bucket_bytes, keep)
    if state is None:
        return None
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, part = _adapter_part(name)
        if part is None:
            out[hf_name(name)] = t  # a modules_to_save copy, trained whole
            continue
        if part == "lora_B":
            t = t.float() * layers[module].scale
        out[f"{module}.{part}"] = t
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    return out


def _adapter_part(name: str) -> tuple[str, str | None]:
    """(module, 'lora_A' | 'lora_B') of an adapter parameter's name; (name, None) for any other."""
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.{ADAPTER}.weight"
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    return name, None


def adapter_file_name(name: str) -> str:
    """PEFT's key in `adapter_model.safetensors` for a trainable parameter of the injected model:
    `base_model.model.` before it and the adapter name taken out (`x.lora_A.default.weight` ->
    `base_model.model.x.lora_A.weight`)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def adapter_state(model: nn.Module, bucket_bytes: int, keep: bool) -> dict[str, torch.Tensor] | None:
    """The trainable tensors of a LoRA model under PEFT's file names (CPU, gathered under ZeRO-3)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    state = cpu_state_dict(trainable, bucket_bytes, keep)
    return None if state is None else {adapter_file_name(n): t for n, t in state.items()}


def save_adapter(path: str | Path, cfg: LoRAConfig, tensors: dict[str, torch.Tensor], base: str) -> None:
    """Write the adapter in PEFT's format into the folder `path`: `adapter_config.json` (naming `base`)
    and `adapter_model.safetensors`; `peft.PeftModel.from_pretrained(base_model, path)` loads it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = peft_config(cfg)
    config.base_model_name_or_path = str(base)
    config.save_pretrained(str(path))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
