"""Statistics over all learner ranks for the reward scale and the critic: running reward moments,
the returns' spread and the critic's explained variance.

The functions take `reduce_sum`, which sums a list of numbers over the learner world and returns
them as a float64 tensor (`ppo_step.all_reduce` bound to "sum"; an identity in one process), so
they run in a single process too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from learner.algorithms import RunningMoments, normalize_scores
from learner.config import LearnerConfig

ReduceSum = Callable[[Sequence[float | torch.Tensor]], torch.Tensor]


def moments_over_ranks(
    x: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum
) -> tuple[float, float, float]:
    """`algorithms.batch_moments` over the valid entries of ALL ranks' `x`: (count, mean, M2), two passes
    in float64 (the global mean first, then the squared deviations from it)."""
    valid = mask.to(torch.bool)
    zero = torch.zeros((), dtype=torch.float64)
    count, total = reduce_sum([valid.sum(), torch.where(valid, x.double(), zero).sum()]).tolist()
    mean = total / max(count, 1.0)
    dev = torch.where(valid, x.double() - mean, zero)
    m2 = float(reduce_sum([(dev**2).sum()])[0])
    return count, mean, m2


def normalized_scores(
    scores: torch.Tensor, config: LearnerConfig, moments: RunningMoments | None, reduce_sum: ReduceSum
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scores that enter the reward: raw, or normalised (`learner.reward_norm`) with the running
    moments of every finite score seen on all ranks, this batch's merged in first."""
    if config.reward_norm == "off":
        return scores, {}
    if moments is None:
        raise ValueError(f"learner.reward_norm={config.reward_norm!r} needs running reward moments")
    # A non-finite score (it skips the step) must not poison the statistics for the rest of the run.
    moments.update(*moments_over_ranks(scores, torch.isfinite(scores), reduce_sum))
    out = normalize_scores(scores, moments.mean, moments.std, config.reward_norm, config.reward_norm_clip)
    return out, {
        "reward_norm/mean": moments.mean,
        "reward_norm/std": moments.std,
        "reward_norm/count": moments.count,
    }


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
