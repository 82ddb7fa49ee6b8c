"""The PPO math for language models, as pure tensor functions: masked statistics and whitening, the
KL estimators and reward shaping, GAE, log-probabilities and entropy from logits, the KL controllers.
The loss terms built on these are in `learner.losses`, the advantage estimators in `learner.advantages`.

Conventions: tensors are batch-first `[B, T]` over response tokens; `mask` is 1 on valid response
tokens (a row's valid tokens are a prefix, padding follows). Every function reads only valid
entries, so whatever sits in padded positions (even NaN) changes no output, and writes 0 there.

References: Schulman et al. 2015 (GAE), Ziegler et al. 2019 (KL control). This module imports
nothing of the project but the registry of names (`learner.registry`, itself import-free).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from learner.registry import KL_ESTIMATORS

# Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp, so one extreme token cannot make a loss
# (and with it the whole minibatch on every rank) infinite. exp(20) ~ 5e8 is far outside any clip.
LOG_RATIO_CLAMP = 20.0


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.to(torch.bool)


def _zero_invalid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` with invalid entries replaced by 0 (where, not multiply: 0 * NaN is NaN)."""
    return torch.where(_valid(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


def count_sequences(mask: torch.Tensor) -> float:
    """Rows with at least one valid entry: a row with none is not a sequence (seq-mean losses)."""
    return float(_valid(mask).any(-1).sum())


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid entries (0 where there are none)."""
    m = mask.to(x.dtype)
    total = _zero_invalid(x, mask).sum() if dim is None else _zero_invalid(x, mask).sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid entries; Bessel-corrected when `unbiased` and there are >= 2."""
    mean = masked_mean(x, mask)
    centered = _zero_invalid(x - mean, mask)
    count = mask.to(x.dtype).sum()
    var = (centered**2).sum() / count.clamp(min=1.0)
    if unbiased and count >= 2:
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over valid entries; `shift_mean=False` adds the mean back (as TRL does)."""
    return whiten_with(x, mask, masked_mean(x, mask), masked_var(x, mask, unbiased=True), shift_mean)


def whiten_with(
    x: torch.Tensor,
    mask: torch.Tensor,
    mean: float | torch.Tensor,
    var: float | torch.Tensor,
    shift_mean: bool = True,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) on valid entries, 0 elsewhere, with given moments; `shift_mean=False`
    adds the mean back. `masked_whiten` passes x's own moments; the learner passes those of all ranks'
    shards (`learner.prepare.distributed_whiten`). Computed in x's dtype."""
    inv_std = torch.rsqrt(torch.as_tensor(var + 1e-8, dtype=x.dtype, device=x.device))
    whitened = (x - mean) * inv_std
    if not shift_mean:
        whitened = whitened + mean
    return _zero_invalid(whitened, mask)


# ---------------------------------------------------------------------------------------------
# KL penalty and reward shaping
# ---------------------------------------------------------------------------------------------


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi by a registered estimator
    (`learner.registry.KL_ESTIMATORS`: Schulman's k1/k2/k3), each a function of d = log pi - log pi_ref."""
    return KL_ESTIMATORS.function(estimator)(logprobs - ref_logprobs)


def kl_k1(d: torch.Tensor) -> torch.Tensor:
    """k1 = d: unbiased, negative on some tokens."""
    return d


def kl_k2(d: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2: biased, low variance, >= 0."""
    return 0.5 * d**2


def kl_k3(d: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r with r = pi_ref / pi = exp(-d): unbiased and >= 0. d is clamped to
    +-LOG_RATIO_CLAMP first: exp(-d) overflows float32 for d below about -88."""
    d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(-d) + d


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last valid token ([B], -1 for a row with none)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(_valid(mask), positions, torch.full_like(positions, -1)).max(dim=-1).values


def episode_return(score, token_rewards, mask=None):
    """A sample's return G = s + sum_t r_t: its score s (on its last token) plus the rewards on its other
    tokens r_t (a multi-turn episode's earlier turns, each on its turn's last token; none for a single
    response, where G = s). Undiscounted: the reward the sample earned, not a value target.

    `score` `[B]` (or a scalar) and `token_rewards` `[B, T]` (or `[T]`), numpy or torch alike; with `mask`
    (torch) only valid tokens count. The one definition every reader of a sample's reward uses: the
    scorer's `ScoreBatch.returns` (dynamic sampling's filter and rollout/reward_mean in the driver), the
    group advantages (grpo, rloo), `learner.reward_norm` and the learner's rollout/reward_mean.
    """
    if mask is not None:
        token_rewards = _zero_invalid(token_rewards, mask)
    return score + token_rewards.sum(-1)


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * KL_t on every valid token, plus the score on the last one.

    The score goes on the last *valid* token (EOS or truncation point), never on padding.
    Returns `(rewards, kl)`, both 0 on invalid tokens.
    """
    kl = _zero_invalid(kl_penalty(logprobs, ref_logprobs, estimator), mask)
    rewards = -kl_coef * kl
    last = last_valid_index(mask)
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    rewards = rewards.clone()
    rewards[rows, last[has_tokens]] += scores.to(rewards.dtype)[has_tokens]
    return _zero_invalid(rewards, mask), kl


# ---------------------------------------------------------------------------------------------
# Generalised advantage estimation
# ---------------------------------------------------------------------------------------------


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) over each row's valid prefix; V after the last valid token is `bootstrap`
    (`[B]`, e.g. V at the cut of a truncated response), 0 (terminal) when None.

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},  R_t = A_t + V_t.
    Vectorised over the batch; the only loop is backwards over time.
    """
    r = _zero_invalid(rewards, mask)
    v = _zero_invalid(values, mask)
    valid = mask.to(r.dtype)
    T = r.shape[-1]
    advantages = torch.zeros_like(r)
    next_adv = torch.zeros_like(r[..., 0])
    next_value = torch.zeros_like(r[..., 0])
    after_last = None
    if bootstrap is not None:  # [B, T]: bootstrap[i] at row i's last valid token, 0 elsewhere
        last = last_valid_index(mask)
        after_last = torch.zeros_like(r)
        has = last >= 0
        after_last[torch.arange(r.shape[0], device=r.device)[has], last[has]] = bootstrap.to(r.dtype)[has]
    for t in range(T - 1, -1, -1):
        if after_last is not None:
            next_value = next_value + after_last[..., t]
        delta = r[..., t] + gamma * next_value - v[..., t]
        next_adv = (delta + gamma * lam * next_adv) * valid[..., t]
        advantages[..., t] = next_adv
        next_value = v[..., t]
    returns = _zero_invalid(advantages + v, mask)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# Log-probabilities and entropy from logits
# ---------------------------------------------------------------------------------------------


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] as logit[token] - logsumexp(logits), in float32.

    Never materialises a full log-softmax tensor; low-precision logits are upcast in chunks of
    rows so the float32 copy stays small.
    """
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1).float()
    if logits.dtype == torch.float32 or logits.dtype == torch.float64:
        return picked - torch.logsumexp(logits, dim=-1).to(picked.dtype)
    flat = logits.reshape(-1, logits.shape[-1])
    lse = torch.cat([torch.logsumexp(chunk.float(), dim=-1) for chunk in flat.split(1024)])
    return picked - lse.reshape(picked.shape)


def _entropy(z: torch.Tensor) -> torch.Tensor:
    z = z.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) * z.

    In chunks of `chunk_rows` positions, each recomputed in the backward pass when it needs a
    gradient (activation checkpointing), so float32 softmax intermediates exist for one chunk at a
    time instead of the whole `[B, R, V]` block."""
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.shape[0] <= chunk_rows:
        return _entropy(flat).reshape(logits.shape[:-1])
    grad = flat.requires_grad and torch.is_grad_enabled()
    parts = [
        torch.utils.checkpoint.checkpoint(_entropy, c, use_reentrant=False) if grad else _entropy(c)
        for c in flat.split(chunk_rows)
    ]
    return torch.cat(parts).reshape(logits.shape[:-1])


# ---------------------------------------------------------------------------------------------
# KL coefficient controllers
# ---------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient beta."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, kl: float, n_steps: int) -> None:
        """Nothing to adapt; kept so both controllers share one interface."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional control of beta towards a target KL (Ziegler et al. 2019, sec. 2.2).

    error = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + error * n_steps / horizon).
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0 (got target={target}, horizon={horizon})")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, kl: float, n_steps: int) -> None:
        error = min(max(float(kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))
