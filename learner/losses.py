"""The terms of the PPO objective, as pure tensor functions: a per-token loss reduced to a scalar, the
clipped policy surrogate (times the rollout-correction weights, `learner.corrections`), and the clipped
value loss.

Conventions as in `learner.algorithms`: tensors are `[B, T]` over response tokens, `mask` is 1 on a
row's valid prefix, invalid entries (even NaN) never change an output. The policy losses (`Surrogate`)
and the loss aggregations (`Aggregate`) are registered in `learner.registry` (POLICY_LOSSES, LOSS_AGGS);
the rollout corrections whose weights multiply the surrogate live in `learner.corrections` (its
`off_policy_weights` is re-exported here). Imports only the pure `learner.algorithms`, `learner.corrections`
and `learner.registry` (no Ray, no DeepSpeed).

References: Schulman et al. 2017 (PPO), Ye et al. 2020 (dual-clip PPO), Zheng et al. 2025 (GSPO), Liu et
al. 2025 (Dr. GRPO).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from learner.algorithms import (
    LOG_RATIO_CLAMP,
    _valid,
    _zero_invalid,
    count_sequences,
    masked_mean,
)
from learner.corrections import off_policy_weights  # noqa: F401 - the corrections' home is learner.corrections
from learner.registry import LOSS_AGGS, POLICY_LOSSES


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    horizon: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar by a registered aggregation (`LOSS_AGGS`).

    `global_tokens` / `global_seqs` are the counts of valid tokens / sequences (rows with at least one
    valid token) over all ranks and micro-batches, so that pieces of a batch add up to the whole-batch
    loss; None counts this `mask`'s. `horizon` is the constant of 'seq-mean-token-sum-norm'.
    """
    fn: Aggregate = LOSS_AGGS.function(agg)
    tokens = mask.to(loss_mat.dtype).sum() if global_tokens is None else global_tokens
    seqs = count_sequences(mask) if global_seqs is None else global_seqs
    return fn(_zero_invalid(loss_mat, mask), mask, Counts(float(tokens), float(seqs), horizon))


@dataclasses.dataclass(frozen=True)
class Counts:
    """The denominators an aggregation may divide by (see `aggregate_loss`)."""

    tokens: float
    sequences: float
    horizon: float | None = None


# An aggregation: (the per-token loss with invalid entries 0, mask, counts) -> scalar.
Aggregate = Callable[[torch.Tensor, torch.Tensor, Counts], torch.Tensor]


def token_mean(masked: torch.Tensor, mask: torch.Tensor, n: Counts) -> torch.Tensor:
    """sum over valid tokens / number of valid tokens (DAPO's token-level loss)."""
    return masked.sum() / max(n.tokens, 1.0)


def seq_mean_token_mean(masked: torch.Tensor, mask: torch.Tensor, n: Counts) -> torch.Tensor:
    """(1/N) sum_i (1/|y_i|) sum_t l_it: each sequence's token mean, then the mean over sequences."""
    per_seq = masked.sum(-1) / mask.to(masked.dtype).sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(n.sequences, 1.0)


def seq_mean_token_sum(masked: torch.Tensor, mask: torch.Tensor, n: Counts) -> torch.Tensor:
    """(1/N) sum_i sum_t l_it: each sequence's token sum, then the mean over sequences."""
    return masked.sum() / max(n.sequences, 1.0)


def seq_mean_token_sum_norm(masked: torch.Tensor, mask: torch.Tensor, n: Counts) -> torch.Tensor:
    """(1/N) sum_i (1/L) sum_t l_it with a constant L = `horizon` (learner.loss_norm_tokens): Dr. GRPO's
    aggregation (Liu et al. 2025, sec. 3.1), which drops GRPO's 1/|y_i| so that a token's weight does
    not depend on its response's length; L (the generation budget) only scales the loss."""
    if n.horizon is None or n.horizon < 1:
        raise ValueError(f"seq-mean-token-sum-norm needs learner.loss_norm_tokens >= 1 (got {n.horizon})")
    return masked.sum() / (max(n.sequences, 1.0) * n.horizon)


@dataclasses.dataclass(frozen=True)
class Clip:
    """The surrogate's clip: ratio in [1 - low, 1 + high] (high = low unless given), and the dual clip c
    (None = off) that caps a negative advantage's loss at -c * A (Ye et al. 2020)."""

    low: float = 0.2
    high: float | None = None
    dual: float | None = None

    def __post_init__(self):
        if self.dual is not None and self.dual <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (got {self.dual})")


@dataclasses.dataclass(frozen=True)
class SurrogateTerms:
    """A policy loss per token, before the off-policy weights and the aggregation, and what its metrics read."""

    per_token: torch.Tensor  # [B, T]
    ratio: torch.Tensor  # [B, T] the ratio the clip acts on
    clipped: torch.Tensor  # [B, T] bool: the clipped branch was the larger loss
    log_ratio: torch.Tensor  # [B, T] log pi - log pi_old per token, clamped to +-LOG_RATIO_CLAMP
    clamped: int  # valid tokens whose log-ratio was clamped


# A policy loss: (logprobs, old_logprobs, advantages, mask, clip) -> its terms.
Surrogate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Clip], SurrogateTerms]


def clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip: Clip
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token max(-A * r, -A * clip(r, 1 - low, 1 + high)), with tokens of A < 0 further capped at -c * A
    under a dual clip. Returns `(loss, clipped branch taken)`."""
    high = clip.low if clip.high is None else clip.high
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip.low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if clip.dual is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -clip.dual * adv), per_token)
    return per_token, clipped > unclipped


def _token_log_ratio(logprobs, old_logprobs, mask) -> tuple[torch.Tensor, int]:
    raw = _zero_invalid(logprobs - old_logprobs, mask)
    return raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), int((raw.abs() > LOG_RATIO_CLAMP).sum())


def ppo_surrogate(logprobs, old_logprobs, advantages, mask, clip: Clip) -> SurrogateTerms:
    """PPO's clipped surrogate on each token's ratio r_t = pi(y_t) / pi_old(y_t) (Schulman et al. 2017)."""
    log_ratio, clamped = _token_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    per_token, hit = clipped_surrogate(ratio, _zero_invalid(advantages, mask), clip)
    return SurrogateTerms(per_token, ratio, hit, log_ratio, clamped)


def gspo_surrogate(logprobs, old_logprobs, advantages, mask, clip: Clip) -> SurrogateTerms:
    """GSPO (Zheng et al. 2025): the clipped surrogate on the sequence's ratio
        s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t log r_it),
    in its GSPO-token form: every token of row i carries s_it = sg(s_i) * pi(y_it) / sg(pi(y_it)), whose
    value is s_i and whose gradient is sg(s_i) * grad log pi(y_it). With one advantage per sequence and
    'seq-mean-token-mean' (the aggregation it is registered with) the loss and its gradient are those of
    (1/N) sum_i max(-A_i s_i, -A_i clip(s_i)), the paper's objective; per-token advantages (e.g. a KL
    penalty in the reward) are used token by token. The clip decision is the sequence's."""
    log_ratio, clamped = _token_log_ratio(logprobs, old_logprobs, mask)
    seq = masked_mean(log_ratio, mask, dim=-1).detach()
    log_s = logprobs - logprobs.detach() + seq.unsqueeze(-1)
    ratio = torch.exp(_zero_invalid(log_s, mask))
    per_token, hit = clipped_surrogate(ratio, _zero_invalid(advantages, mask), clip)
    return SurrogateTerms(per_token, ratio, hit, log_ratio, clamped)


def cispo_surrogate(logprobs, old_logprobs, advantages, mask, clip: Clip) -> SurrogateTerms:
    """CISPO (MiniMax-M1, Chen et al. 2025): the clipped ratio as a stopped coefficient of the policy
    gradient, per token
        L_t = -sg(clip(r_t, 1 - low, 1 + high)) * A_t * log pi(y_t),
    so every token keeps a gradient (PPO's clip zeroes the clipped tokens' gradients; here the weight is
    only bounded). Its paper sets no lower bound (a large `low`) and tunes `high`. The value of L is not
    a surrogate of the return (it reads log pi): only its gradient, sg(clip(r_t)) A_t grad log pi(y_t),
    is. `clipped` marks tokens whose ratio lay outside the range; a dual clip does not apply (refused by
    the config)."""
    log_ratio, clamped = _token_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    high = clip.low if clip.high is None else clip.high
    weight = torch.clamp(ratio, 1.0 - clip.low, 1.0 + high).detach()
    per_token = -weight * _zero_invalid(advantages, mask) * _zero_invalid(logprobs, mask)
    return SurrogateTerms(
        per_token, ratio, (ratio < 1.0 - clip.low) | (ratio > 1.0 + high), log_ratio, clamped
    )


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
    loss: str = "ppo",
    horizon: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A registered policy loss (`POLICY_LOSSES`, PPO's clipped surrogate by default), aggregated.

    `is_weights` (e.g. truncated importance weights for a behaviour/proximal mismatch) multiply the
    per-token loss before the aggregation. Metrics: the fraction of valid tokens on the clipped branch,
    approx_kl = mean of (log r_t)^2 / 2 per token, the mean and max of the clipped ratio, and the count
    of log-ratios clamped to +-LOG_RATIO_CLAMP.
    """
    fn: Surrogate = POLICY_LOSSES.function(loss)
    terms = fn(logprobs, old_logprobs, advantages, mask, Clip(clip_eps, clip_eps_high, dual_clip))
    per_token = terms.per_token
    if is_weights is not None:
        per_token = per_token * _zero_invalid(is_weights, mask)
    value = aggregate_loss(per_token, mask, agg, global_tokens, global_seqs, horizon)

    with torch.no_grad():
        valid = _valid(mask)
        ratio = terms.ratio.detach()
        metrics = {
            "clip_frac": float(masked_mean(terms.clipped.to(ratio.dtype), mask)),
            "approx_kl": float(masked_mean(0.5 * terms.log_ratio.detach() ** 2, mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
            "ratio_max": float(ratio[valid].max()) if bool(valid.any()) else 0.0,
            "log_ratio_clamped": float(terms.clamped),
        }
    return value, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | torch.Tensor | None = 0.2,
    agg: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    horizon: float | None = None,
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
    loss = aggregate_loss(per_token, mask, agg, global_tokens, global_seqs, horizon)
    with torch.no_grad():
        metrics = {"clip_frac": float(masked_mean((err_clipped > err).to(v.dtype), mask))}
    return loss, metrics
