"""The reward scale and the critic: moments of the valid entries over all learner ranks, running
reward moments merged step by step (Chan et al.), score normalisation, the value clip's radius, the
returns' spread and the critic's explained variance.

The cross-rank functions take `reduce_sum`, which sums a list of numbers over the learner world and
returns them as a float64 tensor (`forward.all_reduce` bound to "sum"; an identity in one process),
so they run in a single process too. Nothing here holds torch.distributed state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from learner.algorithms import _zero_invalid, episode_return
from learner.config import LearnerConfig

ReduceSum = Callable[[Sequence[float | torch.Tensor]], torch.Tensor]

REWARD_NORMS = ("off", "scale", "standardize")
VALUE_CLIPS = ("absolute", "relative", "off")


def merge_moments(a: tuple[float, float, float], b: tuple[float, float, float]) -> tuple[float, float, float]:
    """`(count, mean, M2)` of the union of two disjoint sets from theirs (Chan, Golub & LeVeque 1979).

    n = n_a + n_b,  d = mean_b - mean_a,  mean = mean_a + d * n_b / n,  M2 = M2_a + M2_b + d^2 n_a n_b / n.
    Exact in real arithmetic, and stable: no difference of two large sums of squares.
    """
    na, ma, m2a = (float(v) for v in a)
    nb, mb, m2b = (float(v) for v in b)
    n = na + nb
    if nb == 0:
        return na, ma, m2a
    if na == 0:
        return nb, mb, m2b
    d = mb - ma
    return n, ma + d * nb / n, m2a + m2b + d * d * na * nb / n


class RunningMoments:
    """Mean and standard deviation of every number seen so far, merged batch by batch (`merge_moments`).

    The learner feeds it each iteration's sequence returns (`normalized_rewards`) from all ranks, so every
    rank holds the same state; it is saved in checkpoints (`state_dict`) and restored on resume.
    """

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0.0, 0.0, 0.0

    def update(self, count: float, mean: float, m2: float) -> None:
        """Merge in a batch's `(count, mean, M2)`."""
        self.count, self.mean, self.m2 = merge_moments((self.count, self.mean, self.m2), (count, mean, m2))

    @property
    def std(self) -> float:
        """Bessel-corrected standard deviation; 1.0 before two numbers are seen (nothing to scale by)."""
        if self.count < 2:
            return 1.0
        return (self.m2 / (self.count - 1)) ** 0.5

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def normalize_scores(
    scores: torch.Tensor,
    mean: float,
    std: float,
    mode: str = "scale",
    clip: float | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Sequence scores put on a unit scale with running statistics, before the KL penalty is added.

    "off": unchanged; "scale": score / (std + eps) (keeps the sign and the zero of the reward, as
    a logit-difference or a pass/fail reward have a meaningful 0); "standardize": (score - mean) /
    (std + eps). With `clip`, the result is clipped to [-clip, clip] (the "off" mode is never clipped).
    """
    if mode not in REWARD_NORMS:
        raise ValueError(f"unknown reward normalisation {mode!r}; allowed: {', '.join(REWARD_NORMS)}")
    if mode == "off":
        return scores
    centre = mean if mode == "standardize" else 0.0
    out = (scores - centre) / (std + eps)
    return out if clip is None else out.clamp(-clip, clip)


def value_clip_radius(mode: str, eps: float, returns_std: float = 1.0) -> float | None:
    """How far the value may move from the old value in one update: "absolute" eps, "relative"
    eps * std of the returns (the clip follows the scale of the rewards), "off" None (no clip)."""
    if mode not in VALUE_CLIPS:
        raise ValueError(f"unknown value clip {mode!r}; allowed: {', '.join(VALUE_CLIPS)}")
    if mode == "off":
        return None
    return float(eps) * (float(returns_std) if mode == "relative" else 1.0)


def moments_over_ranks(
    x: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum
) -> tuple[float, float, float]:
    """`(count, mean, M2)` of the valid entries of ALL ranks' `x`, M2 the sum of squared deviations from
    the mean: two passes in float64 (the global mean first, then the deviations); (0, 0, 0) when none."""
    valid = mask.to(torch.bool)
    zero = torch.zeros((), dtype=torch.float64)
    count, total = reduce_sum([valid.sum(), torch.where(valid, x.double(), zero).sum()]).tolist()
    mean = total / max(count, 1.0)
    dev = torch.where(valid, x.double() - mean, zero)
    m2 = float(reduce_sum([(dev**2).sum()])[0])
    return count, mean, m2


def normalized_rewards(
    scores: torch.Tensor,
    config: LearnerConfig,
    moments: RunningMoments | None,
    reduce_sum: ReduceSum,
    token_rewards: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The score `[B]` and the per-token rewards `[B, T]` (a multi-turn episode's earlier turns, read on
    `mask`'s valid tokens, every token when None; None: none) that enter the reward: raw, or normalised
    (`learner.reward_norm`) by one rule for both, on each sample's return G = s + sum_t r_t
    (`algorithms.episode_return`):

        mu, sigma = running moments of every finite G seen on all ranks, this batch's merged in first
        r'_t = r_t / (sigma + eps)                         every per-token reward: the same scale as the score
        s'   = norm(G) - sum_t r'_t                        the score (on the last token) takes the rest
        norm(G) = G / (sigma + eps)          'scale'
                  (G - mu) / (sigma + eps)   'standardize'
                  clipped to [-reward_norm_clip, reward_norm_clip] when set

    so a sample's normalised rewards add up to norm(G): unclipped, s' = s / (sigma + eps) ('scale') or
    (s - mu) / (sigma + eps) ('standardize': the mean comes off once, from the score), and a clip bounds the
    return, the score absorbing the difference. Without per-token rewards (single responses) G = s and s' is
    `normalize_scores` of the scores. Returns `(s', r' or None, stats)`."""
    if config.reward_norm == "off":
        return scores, token_rewards, {}
    if moments is None:
        raise ValueError(f"learner.reward_norm={config.reward_norm!r} needs running reward moments")
    turns = None
    if token_rewards is not None:
        turns = token_rewards.double() if mask is None else _zero_invalid(token_rewards.double(), mask)
    returns = scores.double() if turns is None else episode_return(scores.double(), turns)
    # A non-finite score (it skips the step) must not poison the statistics for the rest of the run.
    moments.update(*moments_over_ranks(returns, torch.isfinite(returns), reduce_sum))
    mean, std, mode, clip = moments.mean, moments.std, config.reward_norm, config.reward_norm_clip
    stats = {"reward_norm/mean": mean, "reward_norm/std": std, "reward_norm/count": moments.count}
    if turns is None:
        return normalize_scores(scores, mean, std, mode, clip, eps), None, stats
    turns = turns / (std + eps)
    out = normalize_scores(returns, mean, std, mode, clip, eps) - turns.sum(-1)
    return out.to(scores.dtype), turns.to(token_rewards.dtype), stats


def critic_stats(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum
) -> dict[str, float]:
    """Std of the returns over all ranks' valid tokens and the critic's explained variance
    1 - Var(R - V) / Var(R) (1: perfect, 0: no better than a constant, < 0: worse)."""
    n, _, m2_ret = moments_over_ranks(returns, mask, reduce_sum)
    _, _, m2_err = moments_over_ranks(returns - values, mask, reduce_sum)
    var_ret = m2_ret / (n - 1) if n >= 2 else 0.0
    var_err = m2_err / (n - 1) if n >= 2 else 0.0
    return {
        "returns/std": math.sqrt(var_ret),
        "values/explained_variance": 1.0 - var_err / var_ret if var_ret > 0 else float("nan"),
    }
