"""Token log-probabilities (and entropies) straight from the final hidden states, a chunk of positions at
a time, with the output projection and the log-softmax recomputed in backward: no `[tokens, vocabulary]`
tensor (logits, log-softmax or their gradient) ever exists whole, only `[chunk, vocabulary]` ones.

The fused linear-cross-entropy idea of Liger kernels (Hsu et al. 2024, "Liger Kernel") and verl, as one
`torch.autograd.Function` in plain torch. Conventions: `hidden` `[N, H]` are the lm_head's inputs at the
N scoring positions, `weight` `[V, H]` (and `bias` `[V]`, if any) the lm_head's, `targets` `[N]` the
scored token ids, `T` the sampling temperature. Per position n, with z = (h W^T + b) / T:

    lse = logsumexp(z),   p = softmax(z) = exp(z - lse),   logp = z[target] - lse,
    H = -sum_i p_i log p_i = lse - sum_i p_i z_i.

Gradients (upstream g = dL/dlogp, e = dL/dH, per position):

    dlogp/dz = onehot(target) - p,        dH/dz_j = -p_j (log p_j + H),
    dL/dz = g (onehot - p) - e p (log p + H),
    dL/dh = (dL/dz / T) W,   dL/dW = sum_n (dL/dz_n / T)^T h_n,   dL/db = sum_n dL/dz_n / T.

Forward keeps only `lse` and `H` per position; backward recomputes z chunk by chunk, in place, so at most
two `[chunk, V]` float32 tensors exist at a time. Only valid where the
model's logits are exactly `lm_head(hidden)` (no softcap, no logit scale): `linear_logits_reason`
says which architectures qualify. Imports nothing of the project.
"""

from __future__ import annotations

import torch

# Architectures whose causal-LM logits are exactly `lm_head(final hidden state)` (no softcap, scale or
# multiplier in the output path), read off their modeling code. Anything else keeps the full logits path.
LINEAR_LOGITS_MODEL_TYPES = frozenset({"gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"})
# Config fields that change the output path where set (Gemma-2 softcap, Cohere scale, Granite scaling ...).
_OUTPUT_PATH_FIELDS = (
    "final_logit_softcapping",
    "logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
)


def linear_logits_reason(config) -> str | None:
    """None where the causal LM of `config` (its text config) computes logits as exactly `lm_head(hidden)`;
    else why not (what the error refusing chunked logprobs for this model says)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None)
    if model_type not in LINEAR_LOGITS_MODEL_TYPES:
        known = ", ".join(sorted(LINEAR_LOGITS_MODEL_TYPES))
        return f"model_type {model_type!r} is not one whose logits are known to be lm_head(hidden) ({known})"
    for field in _OUTPUT_PATH_FIELDS:
        value = getattr(text, field, None)
        if value is not None and value != 1.0:
            return f"its config sets {field}={value!r}, which changes the logits after lm_head"
    return None


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: float) -> torch.Tensor:
    """z = (h W^T + b) / T in float32 (float64 for float64 inputs), rounded as the model's own path rounds
    (the projection and the temperature in the weight's dtype, then the upcast: `(lm_head(h) / T).float()`)."""
    z = torch.nn.functional.linear(h, weight, bias)
    z = z / t if t != 1.0 else z
    return z.to(_acc(z.dtype))


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are kept in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTokenScores(torch.autograd.Function):
    """(logp [N], H [N]) from (hidden, weight, bias, targets); see the module docstring for the math."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=_acc(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for s in range(0, n, chunk):
            z = _logits(hidden[s : s + chunk], weight, bias, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk] = lse_c
            logp[s : s + chunk] = z.gather(-1, targets[s : s + chunk].unsqueeze(-1)).squeeze(-1) - lse_c
            if ent is not None:  # H = lse - sum p z, the dot product without a third [chunk, V] tensor
                p = (z - lse_c.unsqueeze(-1)).exp_()
                ent[s : s + chunk] = lse_c - (p.unsqueeze(-2) @ z.unsqueeze(-1)).reshape(-1)
                del p
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        if ent is None:
            ctx.mark_non_differentiable(lse)
            return logp, lse  # lse stands in for the absent entropy output (non-differentiable)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc = _acc(weight.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            g = g_logp[s : s + chunk].unsqueeze(-1)
            logp_all = _logits(h, weight, bias, t).sub_(lse[s : s + chunk].unsqueeze(-1))
            dz = logp_all.exp()
            if ent is not None and g_ent is not None:  # dz = -p (g + e (log p + H)), in place
                e = g_ent[s : s + chunk].unsqueeze(-1)
                dz.mul_(logp_all.add_(ent[s : s + chunk].unsqueeze(-1)).mul_(e).add_(g)).neg_()
            else:
                dz.mul_(-g)
            del logp_all
            dz.scatter_add_(-1, targets[s : s + chunk].unsqueeze(-1), g.to(dz.dtype))
            if t != 1.0:
                dz.div_(t)
            if need_h:
                grad_h[s : s + chunk] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(dz.t(), h.to(acc))
            if need_b:
                grad_b += dz.sum(0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_token_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logp [...], entropy [...] or None)` in float32 (float64 for float64 inputs) of `targets [...]` under softmax((h W^T + b) / T)
    for `hidden [..., H]`, at most `chunk_tokens` positions' `[chunk, V]` logits alive at once (in forward
    and in backward). Equal, up to float rounding order, to `log_softmax(lm_head(hidden) / T)[target]`
    (and its entropy) with the gradients of that computation w.r.t. hidden, weight and bias."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _ChunkedTokenScores.apply(
        flat_h, weight, bias, targets.reshape(-1), float(temperature), int(chunk_tokens), bool(entropy)
    )
    return logp.reshape(shape), (ent.reshape(shape) if entropy else None)
