"""The experts a mixture of experts routes each token to: recorded from a forward, and replayed into one
(rollout routing replay, R3: arXiv 2510.11370), on transformers' MoE blocks (docs/moe.md).

transformers 5.24's MoE layers (`model.layers[i].mlp`, Qwen3-MoE, Mixtral and the other fused-expert
families) hold a router `gate` and fused `experts`; the router maps the block's flattened input
[N, H] (N = batch x positions, in the batch's own layout: padding or packing included) to
`(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])` and the block hands the last two to
the experts. `record_routing` keeps each router's `top_k_index`; `replay_routing` replaces it by given
indices and recomputes the gate values from the live logits at those experts,

    w_{n,j} = p_{n, I_{n,j}} / sum_j' p_{n, I_{n,j'}},    p_n = softmax(router_logits_n)   (float32),

renormalised where the router renormalises its own top-k (Mixtral always, Qwen3-MoE where
`norm_topk_prob`), un-normalised p otherwise, and cast to the dtype the router returns: so the router's
weight still gets a gradient through w, and replaying a forward's own choices gives that forward
exactly. A token whose replayed row holds an entry outside [0, E) (`NOT_RECORDED`, 255 in uint8: the
positions no engine routed, padding and a sample's last token) keeps the router's own choice. A leaf module (imports nothing of the project); the engine and the learner share it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

NOT_RECORDED = 255  # a token's replayed row of this value: no recorded routing, the router's own choice


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model`'s MoE layers in layer order: the `gate` of every module that holds both a
    `gate` and an `experts` module with a 3-D (fused) parameter (3-D in full: under ZeRO-3 too). Through PEFT's wrappers (LoRA on the
    expert stacks or on the router: `base_layer`, nested) the innermost modules count: the router is the
    wrapped one, whose forward the wrapper calls with the adapted weight."""
    out = []
    for module in model.modules():
        gate, experts = (
            _innermost(getattr(module, "gate", None)),
            _innermost(getattr(module, "experts", None)),
        )
        fused = isinstance(experts, nn.Module) and any(
            len(_full_shape(p)) == 3 for p in experts.parameters(recurse=False)
        )
        if isinstance(gate, nn.Module) and fused and gate not in out:
            out.append(gate)
    return out


def _full_shape(p: nn.Parameter) -> tuple[int, ...]:
    """A parameter's own shape, also where DeepSpeed ZeRO-3 partitioned it (the local tensor is then empty,
    1-D, and the full shape is its `ds_shape`)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def _innermost(module):
    """`module` with PEFT's wrappers peeled off (`base_layer`, nested)."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def replayed_gate_weights(
    router_logits: torch.Tensor, index: torch.Tensor, renormalize: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Gate values at the replayed experts `index` [N, k] from the live `router_logits` [N, E]:
    softmax in float32, gathered, renormalised over the k chosen when `renormalize`, cast to `dtype`."""
    probs = torch.softmax(router_logits.float(), dim=-1).gather(-1, index)
    if renormalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(dtype)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Inside, every forward of `model` appends each MoE layer's `top_k_index` [N, k] (uint8 where E < 256,
    else int16) to the yielded list of per-layer lists."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no MoE layers (no module with a gate and fused experts)"
        )
    taken: list[list[torch.Tensor]] = [[] for _ in routers]

    def keep(i: int):
        def hook(module, args, out):
            small = torch.uint8 if out[0].shape[-1] < NOT_RECORDED else torch.int16
            taken[i].append(out[2].detach().to(small))

        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    try:
        yield taken
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replay_routing(model: nn.Module, indices: list[torch.Tensor]) -> Iterator[None]:
    """Inside, each MoE layer i of `model` routes its N tokens to `indices[i]` [N, k] (any integer dtype)
    instead of its own top-k, with the gate values recomputed from its live logits
    (`replayed_gate_weights`). One entry per MoE layer, laid out as the forward's flattened tokens; a
    token whose row holds an entry outside [0, E) (`NOT_RECORDED`) keeps its own top-k."""
    routers = moe_routers(model)
    if len(indices) != len(routers):
        raise ValueError(f"{len(indices)} layers of routing for a model with {len(routers)} MoE layers")

    def replace(i: int):
        def hook(module, args, out):
            logits, weights, own = out
            index = indices[i].to(device=own.device).long()
            if index.shape != own.shape:
                raise ValueError(
                    f"MoE layer {i}: replayed routing {tuple(index.shape)}, tokens {tuple(own.shape)}"
                )
            unrecorded = ((index < 0) | (index >= logits.shape[-1])).any(-1, keepdim=True)
            index = torch.where(unrecorded, own.long(), index).to(own.dtype)
            renorm = bool(getattr(module, "norm_topk_prob", True))
            return logits, replayed_gate_weights(logits, index, renorm, weights.dtype), index

        return hook

    handles = [r.register_forward_hook(replace(i)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
