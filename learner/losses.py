"""The terms of the PPO objective, as pure tensor functions: a per-token loss reduced to a scalar, the
clipped policy surrogate, the off-policy (decoupled PPO) weights that multiply it, and the clipped value loss.

Conventions as in `learner.algorithms`: tensors are `[B, T]` over response tokens, `mask` is 1 on a
row's valid prefix, invalid entries (even NaN) never change an output. Imports only the pure
`learner.algorithms` (no Ray, no DeepSpeed).

References: Schulman et al. 2017 (PPO), Ye et al. 2020 (dual-clip PPO), Espeholt et al. 2018 (truncated
importance sampling).
"""

from __future__ import annotations

import torch

from learner.algorithms import (
    LOG_RATIO_CLAMP,
    _valid,
    _zero_invalid,
    count_sequences,
    kl_penalty,
    masked_mean,
)

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
OFF_POLICY_MODES = ("none", "tis", "mask", "geo_mask")


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar.

    "token-mean": sum over valid tokens / number of valid tokens, or / `global_tokens`, the count
    over all ranks and micro-batches, so that pieces of a batch add up to the whole-batch loss.
    "seq-mean-token-mean" / "seq-mean-token-sum": per-sequence mean / sum of its valid tokens,
    then the mean over the sequences that have at least one valid token (or sum / `global_seqs`, the
    same count over all ranks and micro-batches, for the same additivity).
    """
    masked = _zero_invalid(loss_mat, mask)
    if agg == "token-mean":
        denom = mask.to(loss_mat.dtype).sum() if global_tokens is None else global_tokens
        return masked.sum() / max(float(denom), 1.0)
    if agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        per_seq = masked.sum(-1)
        if agg == "seq-mean-token-mean":
            per_seq = per_seq / mask.to(loss_mat.dtype).sum(-1).clamp(min=1.0)
        denom = count_sequences(mask) if global_seqs is None else global_seqs
        return per_seq.sum() / max(float(denom), 1.0)
    raise ValueError(f"unknown loss aggregation {agg!r}; allowed: {', '.join(LOSS_AGGS)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017), optional asymmetric and dual clip.

    Per token: max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high)); with `dual_clip=c`, tokens
    with A < 0 are further capped at -c * A (Ye et al. 2020). `is_weights` (e.g. truncated
    importance weights for a behaviour/proximal mismatch) multiply the per-token loss.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip})")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    raw_log_ratio = _zero_invalid(logprobs - old_logprobs, mask)
    log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = _zero_invalid(advantages, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        capped = torch.minimum(per_token, -dual_clip * adv)
        per_token = torch.where(adv < 0, capped, per_token)
    if is_weights is not None:
        per_token = per_token * _zero_invalid(is_weights, mask)
    loss = aggregate_loss(per_token, mask, agg, global_tokens, global_seqs)

    with torch.no_grad():
        valid = _valid(mask)
        n = int(valid.sum())
        metrics = {
            "clip_frac": float(masked_mean((clipped > unclipped).to(ratio.dtype), mask)),
            "approx_kl": float(masked_mean(0.5 * log_ratio**2, mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
            "ratio_max": float(ratio[valid].max()) if n else 0.0,
            "log_ratio_clamped": float((raw_log_ratio.abs() > LOG_RATIO_CLAMP).sum()),
        }
    return loss, metrics


def off_policy_weights(
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "tis",
    cap: float = 2.0,
    geo_bounds: tuple[float, float] = (0.5, 2.0),
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights correcting for sampling from the behaviour policy mu instead of pi_prox.

    With rho_t = pi_prox(y_t) / mu(y_t) (decoupled PPO: the ratio and clip are taken against pi_prox,
    this weight carries the behaviour/proximal mismatch):
      "none"     1 everywhere;
      "tis"      min(rho_t, cap)                      (truncated importance sampling, Espeholt et al. 2018);
      "mask"     1[rho_t <= cap]                      (token rejection);
      "geo_mask" 1[lo <= exp(mean_t log rho_t) <= hi] for every token of the sequence (sequence rejection
                 on the geometric mean of the ratios).
    Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp. Returns `(weights [B, T], metrics)`;
    weights are 0 on invalid tokens. Metrics: mean/max weight, fraction of valid tokens clipped or
    masked, and KL(mu || pi_prox) by the k3 estimator over valid tokens.
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off-policy correction {mode!r}; allowed: {', '.join(OFF_POLICY_MODES)}")
    if cap <= 0:
        raise ValueError(f"off-policy cap must be > 0 (got {cap})")
    lo, hi = geo_bounds
    if not 0 < lo <= 1 <= hi:
        raise ValueError(f"geo_mask bounds must satisfy 0 < lo <= 1 <= hi (got {geo_bounds})")
    valid = _valid(mask)
    log_rho = _zero_invalid(prox_logprobs - behaviour_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)
    if mode == "none":
        w = torch.ones_like(rho)
        hit = torch.zeros_like(valid)
    elif mode == "tis":
        w = rho.clamp(max=cap)
        hit = rho > cap
    elif mode == "mask":
        hit = rho > cap
        w = (~hit).to(rho.dtype)
    else:
        n_tok = mask.to(rho.dtype).sum(-1)
        geo = torch.exp(log_rho.sum(-1) / n_tok.clamp(min=1.0))
        keep_seq = (geo >= lo) & (geo <= hi)
        hit = (~keep_seq).unsqueeze(-1).expand_as(valid)
        w = keep_seq.to(rho.dtype).unsqueeze(-1).expand_as(rho).clone()
    w = _zero_invalid(w, mask)
    with torch.no_grad():
        n = int(valid.sum())
        metrics = {
            "weight_mean": float(masked_mean(w, mask)),
            "weight_max": float(w[valid].max()) if n else 0.0,
            "clipped_frac": float(masked_mean((hit & valid).to(rho.dtype), mask)),
            # KL(mu || pi_prox) from samples of mu: k3 with r = pi_prox / mu.
            "behaviour_kl": float(masked_mean(kl_penalty(behaviour_logprobs, prox_logprobs, "k3"), mask)),
        }
    return w, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | torch.Tensor | None = 0.2,
    agg: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss: 1/2 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2).

    `clip_eps` is the clip radius: a number, a per-token tensor (e.g. from `value_clip_radius`), or
    None for the plain 1/2 * (V - R)^2 (no clip: the critic may move any distance per update).
    """
    v = _zero_invalid(values, mask)
    v_old = _zero_invalid(old_values, mask)
    ret = _zero_invalid(returns, mask)
    if clip_eps is None:
        v_clipped = v
    elif isinstance(clip_eps, torch.Tensor):
        eps = _zero_invalid(clip_eps.to(v.dtype), mask)
        v_clipped = v_old + torch.maximum(torch.minimum(v - v_old, eps), -eps)
    else:
        v_clipped = v_old + torch.clamp(v - v_old, -clip_eps, clip_eps)
    err = (v - ret) ** 2
    err_clipped = (v_clipped - ret) ** 2
    per_token = 0.5 * torch.maximum(err, err_clipped)
    loss = aggregate_loss(per_token, mask, agg, global_tokens, global_seqs)
    with torch.no_grad():
        metrics = {"clip_frac": float(masked_mean((err_clipped > err).to(v.dtype), mask))}
    return loss, metrics
