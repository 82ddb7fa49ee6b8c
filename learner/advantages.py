"""Advantage estimators behind one registry, as pure tensor functions.

Conventions as in `learner.algorithms`: tensors are `[B, T]` over response tokens, `mask` is 1 on a
row's valid tokens (a prefix, or with gaps at the observation tokens of multi-turn episodes: `estimate`
skips them), invalid entries never change an output and are written as 0. Per-sequence
tensors are `[B]`. `groups[i]` is an integer id: rows with equal ids are samples of the same prompt
(a group); the caller guarantees a group is never split between learner ranks, so every group
statistic here is local.

The estimators are registered in `learner.registry.ADVANTAGES` (gae, grpo, rloo, reinforce_pp,
vtrace: each with its paper and needs); each is a function `Estimate` of one `AdvantageInputs` and one
`AdvantageParams`, called through `estimate`. For the outcome estimators (grpo, rloo) a per-token KL
penalty in the reward (kl.mode='reward') adds its discounted return-to-go to the broadcast outcome
advantage. Imports only the pure `learner.algorithms` and `learner.registry`, so any role may use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from learner.algorithms import (
    LOG_RATIO_CLAMP,
    _zero_invalid,
    compute_gae,
    episode_return,
    kl_penalty,
    last_valid_index,
    masked_whiten,
)
from learner.registry import ADVANTAGES


def needs_critic(estimator: str) -> bool:
    """Whether `estimator` uses a learned value function."""
    return ADVANTAGES[estimator].critic


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator reads: `[B, T]` over response tokens, `[B]` per sequence.

    `rewards` are the shaped per-token rewards (KL penalty on every token, `scores` added on the last);
    `values` the critic's V(x_t) (read by the critic estimators only); `groups` the prompt id of each
    sample (group estimators); `log_rho` = log pi - log mu (vtrace); `bootstrap` the value after each
    row's last token (None or 0 = terminal).
    """

    scores: torch.Tensor
    rewards: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    groups: torch.Tensor | None = None
    log_rho: torch.Tensor | None = None
    bootstrap: torch.Tensor | None = None

    def gathered(self, index: torch.Tensor) -> AdvantageInputs:
        """The per-token tensors gathered along T by `index` `[B, T]`; per-sequence ones unchanged."""
        take = lambda x: None if x is None else x.gather(1, index)  # noqa: E731
        return dataclasses.replace(
            self,
            rewards=take(self.rewards),
            values=take(self.values),
            mask=take(self.mask),
            log_rho=take(self.log_rho),
        )


@dataclasses.dataclass(frozen=True)
class AdvantageParams:
    """An estimator's settings: gamma, then the fields of the estimator's parameter block
    (learner/estimator_params.py: lam of gae and vtrace, norm_adv_by_std of grpo, rho_clip and c_clip of
    vtrace; unread by the others). `whiten(x, mask)` normalises over the global batch (reinforce_pp),
    across ranks in the learner."""

    gamma: float
    lam: float = 1.0
    norm_adv_by_std: bool = True
    rho_clip: float = 1.0
    c_clip: float = 1.0
    whiten: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_whiten


# An estimator: `(advantages, returns)` `[B, T]`, 0 on invalid tokens; `returns` are the critic's
# targets (0 for estimators without a critic).
Estimate = Callable[[AdvantageInputs, AdvantageParams], tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# Sequence-level pieces
# ---------------------------------------------------------------------------------------------


def missing_eos_penalty(scores: torch.Tensor, truncated: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """`scores - penalty` for responses cut at max_new_tokens (no EOS), unchanged otherwise (None = off)."""
    if penalty is None:
        return scores
    return scores - penalty * truncated.to(scores.dtype)


def overlong_penalty(
    lengths: torch.Tensor, max_tokens: int | None, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) `[B]` for response lengths `[B]` (tokens).

    With L_max = `max_tokens` (rollout.sampling.max_new_tokens) and B = `buffer`:
        0                                   L <= L_max - B
        ((L_max - B) - L) / B * factor      L_max - B < L <= L_max    (0 down to -factor at L_max)
        -factor                             L > L_max                 (never produced by the workers)
    `buffer` = 0 turns it off (all zeros, `max_tokens` not needed). float64 for exact arithmetic.
    """
    if buffer < 0 or factor <= 0:
        raise ValueError(f"overlong_penalty: buffer must be >= 0 and factor > 0 (got {buffer}, {factor})")
    lengths = lengths.to(torch.float64)
    if buffer == 0:
        return torch.zeros_like(lengths)
    if max_tokens is None or not 0 < buffer <= max_tokens:
        raise ValueError(
            f"overlong_penalty: buffer={buffer} needs 0 < buffer <= max_tokens (got max_tokens={max_tokens})"
        )
    expected = float(max_tokens - buffer)
    ramp = (expected - lengths) / buffer * factor
    return ramp.clamp(min=-factor, max=0.0)


def length_shaped_scores(
    scores: torch.Tensor,
    truncated: torch.Tensor,
    lengths: torch.Tensor,
    *,
    eos_penalty: float | None = None,
    max_tokens: int | None = None,
    buffer: int = 0,
    factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The score the learner trains on after both length-based shapings, and the overlong part alone.

    The one rule: the two shapings are independent terms and ADD (each is 0 when off):
        score' = score - missing_eos_penalty * 1[truncated] + overlong_penalty(L)
    `missing_eos_penalty` is a cliff for a response cut at max_new_tokens without an EOS; the overlong
    penalty is a ramp on length alone, EOS or not. A truncated response has L = L_max (the workers' contract),
    so with both on it gets -(missing_eos_penalty + factor); a response that ends with its EOS on the last
    allowed token gets only -factor. Both are applied to the raw score, before `learner.reward_norm` and
    the KL penalty. Returns `(score', overlong part)`, both `[B]` in the scores' dtype.
    """
    over = overlong_penalty(lengths, max_tokens, buffer, factor)
    shaped = missing_eos_penalty(scores, truncated, eos_penalty)
    if buffer == 0:
        return shaped, over.to(scores.dtype)
    return (shaped.double() + over).to(scores.dtype), over.to(scores.dtype)


def overlong_filter_mask(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: `mask` `[B, T]` with every token of a truncated row `[B]` set to 0, so a
    response cut at max_new_tokens contributes no token to any loss term (same dtype as `mask`)."""
    keep = ~truncated.to(torch.bool).to(mask.device)
    return torch.where(keep.unsqueeze(-1), mask, torch.zeros((), dtype=mask.dtype, device=mask.device))


def _dense(groups: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Group ids mapped to 0..G-1, and G."""
    uniq, inverse = torch.unique(groups, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_sums(scores: torch.Tensor, groups: torch.Tensor):
    """float64 scores, dense group index, and each sample's group size and group mean."""
    s = scores.double()
    idx, G = _dense(groups)
    n = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, torch.ones_like(s))
    total = torch.zeros(G, dtype=s.dtype).index_add_(0, idx, s)
    return s, idx, n, total / n


def grpo_advantages(
    scores: torch.Tensor, groups: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's outcome advantage `[B]`: a_i = s_i - mean_g, divided by (std_g + eps) when `std_normalize`
    (std with Bessel's correction; a group of one has std 0 and advantage 0). Without the std it is
    Dr. GRPO's advantage (Liu et al. 2025)."""
    s, idx, n, mean = _group_sums(scores, groups)
    centered = s - mean[idx]
    if std_normalize:
        sq = torch.zeros_like(n).index_add_(0, idx, centered**2)
        std = torch.sqrt(sq / (n - 1).clamp(min=1.0))
        centered = centered / (std[idx] + eps)
    return centered.to(scores.dtype)


def rloo_advantages(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO's outcome advantage `[B]`: a_i = s_i - (sum_g - s_i) / (n_g - 1) = n_g / (n_g - 1) * (s_i - mean_g);
    0 for a group of one (no other sample to form a baseline)."""
    s, idx, n, mean = _group_sums(scores, groups)
    n_i = n[idx]
    adv = torch.where(n_i > 1, (s - mean[idx]) * n_i / (n_i - 1).clamp(min=1.0), torch.zeros_like(s))
    return adv.to(scores.dtype)


# ---------------------------------------------------------------------------------------------
# Token-level pieces
# ---------------------------------------------------------------------------------------------


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) r_k over each row's valid prefix (GAE with V = 0 and lambda = 1)."""
    advantages, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return advantages


def vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rho: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float = 1.0,
    rho_clip: float = 1.0,
    c_clip: float = 1.0,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace (Espeholt et al. 2018, eq. 1 and sec. 4.1) over each row's valid prefix.

    `log_rho` = log pi(a_t|x_t) - log mu(a_t|x_t): the policy at train time against the behaviour
    policy that sampled the tokens. With rho_t = min(rho_clip, pi/mu) and c_t = lam * min(c_clip, pi/mu):
      delta_t = rho_t * (r_t + gamma * V(x_{t+1}) - V(x_t))
      v_t     = V(x_t) + delta_t + gamma * c_t * (v_{t+1} - V(x_{t+1}))        (the critic's targets)
      A_t     = rho_t * (r_t + gamma * v_{t+1} - V(x_t))                        (policy-gradient advantage)
    After a row's last valid token V = v = `bootstrap` (0 = terminal). With pi = mu and
    rho_clip = c_clip = 1 the targets are GAE(lambda) returns, and at lambda = 1 both outputs are
    GAE(lambda=1): the Monte-Carlo return and return - V. Returns `(A, v)`, 0 on invalid tokens.
    """
    if not (rho_clip > 0 and c_clip > 0):
        raise ValueError(f"rho_clip and c_clip must be > 0 (got {rho_clip}, {c_clip})")
    r = _zero_invalid(rewards, mask)
    v = _zero_invalid(values, mask)
    valid = mask.to(r.dtype)
    ratio = torch.exp(_zero_invalid(log_rho, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    rho = ratio.clamp(max=rho_clip)
    c = lam * ratio.clamp(max=c_clip)
    B, T = r.shape
    boot = torch.zeros(B, dtype=r.dtype, device=r.device) if bootstrap is None else bootstrap.to(r.dtype)
    # V(x_{t+1}): the next value inside a row, the bootstrap value right after its last valid token.
    delta = rho * (r + gamma * _next(v, mask, boot) - v)
    targets = torch.zeros_like(r)
    corr = torch.zeros_like(r[:, 0])  # v_{t+1} - V(x_{t+1}); 0 after the last valid token
    for t in range(T - 1, -1, -1):
        corr = (delta[:, t] + gamma * c[:, t] * corr) * valid[:, t]
        targets[:, t] = v[:, t] + corr
    adv = rho * (r + gamma * _next(targets, mask, boot) - v)
    return _zero_invalid(adv, mask), _zero_invalid(targets, mask)


def _next(x: torch.Tensor, mask: torch.Tensor, after_last: torch.Tensor) -> torch.Tensor:
    """x_{t+1} inside each row's valid prefix, `after_last[i]` right after row i's last valid token."""
    nxt = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
    last = last_valid_index(mask)
    has = last >= 0
    rows = torch.arange(x.shape[0], device=x.device)[has]
    nxt[rows, last[has]] = after_last[has]
    return _zero_invalid(nxt, mask)


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL loss term with gradient through `logprobs` (kl.mode='loss'; aggregate it like the policy loss).

    With d = log pi - log pi_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d. As functions of log pi their
    gradients are 1, d and 1 - pi_ref/pi: k3 pushes log pi down where pi > pi_ref and up where pi < pi_ref,
    and vanishes at pi = pi_ref. Log-ratios are clamped to +-LOG_RATIO_CLAMP before exp.
    """
    return kl_penalty(logprobs, ref_logprobs, estimator)  # the same estimators, with gradient


def has_gaps(mask: torch.Tensor) -> bool:
    """Whether some row's valid tokens are not one prefix (a valid token after an invalid one)."""
    valid = mask > 0
    return bool((valid[:, 1:] & ~valid[:, :-1]).any())


def compaction(mask: torch.Tensor) -> torch.Tensor:
    """Index `[B, T]` that gathers each row's valid tokens first, in order, then its invalid ones."""
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, pos, pos + T).argsort(dim=-1)


def uncompact(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Undo `x.gather(1, index)` (a permutation of each row)."""
    return torch.zeros_like(x).scatter(1, index, x)


def place_token_rewards(
    estimator: str,
    rewards: torch.Tensor,
    scores: torch.Tensor,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rewards, scores)` with the per-token rewards of multi-turn episodes (each earlier turn's reward
    on its last token) added: on their tokens for token-level estimators; for the outcome estimators
    (`Estimator.outcome`: grpo, rloo), whose advantage is the episode's outcome, into the score, which becomes the episode's
    return (`algorithms.episode_return`) and also stands on the last token of `rewards` so the KL part they
    take from it stays the same."""
    extra = _zero_invalid(token_rewards.to(rewards.dtype), mask)
    if not ADVANTAGES[estimator].outcome:
        return rewards + extra, scores
    on_last = _next(torch.zeros_like(rewards), mask, extra.sum(-1))
    return rewards + on_last, episode_return(scores, extra.to(scores.dtype))


# ---------------------------------------------------------------------------------------------
# The estimators (registered in learner.registry.ADVANTAGES)
# ---------------------------------------------------------------------------------------------


def estimate(estimator: str, x: AdvantageInputs, p: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """`(advantages, returns)` `[B, T]` of a registered estimator, before any optional whitening by the caller.

    A mask with gaps (the observation tokens of multi-turn episodes) is handled here, once for every
    estimator, by skipping them: the valid tokens of each row are moved together in order, estimated as
    one prefix, and put back. So the step after an action is the next action (V of the next model
    token, r of the next model token), and observation tokens are no time step: no advantage, no value
    target, no discounting.
    """
    fn: Estimate = ADVANTAGES.function(estimator)
    if not has_gaps(x.mask):
        return fn(x, p)
    index = compaction(x.mask)
    adv, ret = fn(x.gathered(index), p)
    return uncompact(adv, index), uncompact(ret, index)


def gae_estimate(x: AdvantageInputs, p: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) advantages and lambda-returns (Schulman et al. 2015), bootstrapped where given."""
    return compute_gae(x.rewards, x.values, x.mask, p.gamma, p.lam, bootstrap=x.bootstrap)


def vtrace_estimate(x: AdvantageInputs, p: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace advantages and targets (`vtrace`) from log_rho = log pi - log mu."""
    if x.log_rho is None:
        raise ValueError("vtrace needs log_rho = log pi - log mu")
    return vtrace(x.rewards, x.values, x.log_rho, x.mask, p.gamma, p.lam, p.rho_clip, p.c_clip, x.bootstrap)


def reinforce_pp_estimate(x: AdvantageInputs, p: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): the return-to-go of the shaped reward, whitened over the global batch."""
    return p.whiten(returns_to_go(x.rewards, x.mask, p.gamma), x.mask), torch.zeros_like(x.rewards)


def grpo_estimate(x: AdvantageInputs, p: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's group advantage (`grpo_advantages`) on every token, plus the KL part's return-to-go."""
    return _outcome_estimate(
        x, p, grpo_advantages(x.scores, _groups(x, "grpo"), std_normalize=p.norm_adv_by_std)
    )


def rloo_estimate(x: AdvantageInputs, p: AdvantageParams) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's leave-one-out advantage (`rloo_advantages`) on every token, plus the KL part's return-to-go."""
    return _outcome_estimate(x, p, rloo_advantages(x.scores, _groups(x, "rloo")))


def _groups(x: AdvantageInputs, estimator: str) -> torch.Tensor:
    if x.groups is None:
        raise ValueError(f"{estimator} needs the group id of every sample")
    return x.groups


def _outcome_estimate(
    x: AdvantageInputs, p: AdvantageParams, seq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-sequence outcome advantage `seq` `[B]` broadcast to every valid token, plus the discounted
    return-to-go of the KL part of the shaped reward (each row's score taken off its last valid token)."""
    rewards, mask = x.rewards, x.mask
    on_last = _next(torch.zeros_like(rewards), mask, x.scores.to(rewards.dtype))  # score on the last token
    kl_part = _zero_invalid(rewards, mask) - on_last
    adv = seq.to(rewards.dtype).unsqueeze(-1) + returns_to_go(kl_part, mask, p.gamma)
    return _zero_invalid(adv, mask), torch.zeros_like(rewards)
