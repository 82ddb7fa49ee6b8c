"""The probe's logprobs from the exported weights: the learner's side of a weight push without ZeRO-3's hooks.

A push that scores the probe (`rollout.probe_every`) compares what an engine computes with what the
learner computes on a few fixed sequences (`kernel.sequences.probe_sequences`). Under ZeRO-3 a
forward of the training engine fetches every parameter through DeepSpeed's per-module hooks, one
collective each (at 0.5B over gloo: 3.7-5.6 s, against 1.8-2.6 s for the export's bucketed gather of
the same bytes). The export has just gathered the full weights onto rank 0, so on a CPU learner rank 0
scores the probe from them instead (learner.rank.LearnerRank.export_weights), and the other ranks do
not take part (on a GPU the forward over NCCL is cheaper than moving the bundle back):

- an empty skeleton of the policy's architecture (`accelerate.init_empty_weights`: parameters on the
  meta device, buffers such as rotary frequencies built for real) takes the bundle's tensors as its
  parameters, without a copy;
- each module's floating parameters are moved to `device` and cast to the learner's `dtype` only for
  that module's own forward, then dropped, so the extra memory is one module's weights (the largest
  is the embedding), never a second copy of the model.

With a rollout dtype coarser than the learner's (bf16 bundle, fp32 learner) the probe is computed in
the learner's dtype on the weights the engine was sent: the rounding of the weights is then out of the
comparison, which checks the engine's arithmetic; the digests check the weights themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from kernel.sequences import right_padded, sequence_logprobs


def skeleton(config) -> nn.Module:
    """The causal LM of `config` with its parameters on the meta device (no memory) and real buffers."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def _cast_for_own_forward(model: nn.Module, device: torch.device, dtype: torch.dtype) -> list:
    """Hooks that give each module its floating parameters on `device` in `dtype` for the length of its
    own forward and put the originals back after it; returns the handles."""
    handles = []
    for module in model.modules():
        own = {n: p for n, p in module.named_parameters(recurse=False) if p.is_floating_point()}
        if not own:
            continue

        def cast(mod, args, own=own):
            for n, p in own.items():
                mod._parameters[n] = nn.Parameter(p.to(device=device, dtype=dtype), requires_grad=False)

        def restore(mod, args, out, own=own):
            for n, p in own.items():
                mod._parameters[n] = p

        handles += [module.register_forward_pre_hook(cast), module.register_forward_hook(restore)]
    return handles


@torch.no_grad()
def bundle_probe_logprobs(
    config,
    bundle: Mapping[str, torch.Tensor],
    sequences: Sequence[np.ndarray],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[np.ndarray]:
    """Teacher-forced logprobs (temperature 1) of tokens 1.. of each of `sequences` under the causal LM of
    `config` holding the weights of `bundle` (its full state dict under HF names, any floating dtype),
    computed on `device` in `dtype`. A bundle that lacks one of the model's parameters or has a name the
    model does not know raises a KeyError naming them: nothing is scored with a half-loaded model."""
    model = skeleton(config)
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    persistent = set(model.state_dict())  # parameters and persistent buffers
    missing = sorted(expected - set(bundle))
    unknown = sorted(set(bundle) - persistent)
    if missing or unknown:
        raise KeyError(
            f"the probe's bundle does not match the policy: missing {missing[:5]} ({len(missing)}), "
            f"unknown {unknown[:5]} ({len(unknown)})"
        )
    model.load_state_dict(dict(bundle), strict=False, assign=True)
    for module in model.modules():  # buffers (rotary frequencies, masks) go to the device as they are
        for n, b in module.named_buffers(recurse=False):
            module._buffers[n] = b.to(device)
    handles = _cast_for_own_forward(model, torch.device(device), dtype)
    try:
        ids, mask = right_padded(sequences, device)
        logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in handles:
            h.remove()
    lengths = mask.sum(-1).tolist()
    return [
        sequence_logprobs(lg[:n], row[:n]).cpu().numpy()
        for lg, row, n in zip(logits, ids, lengths, strict=True)
    ]
