"""The `loss_fn` names of the Tinker API, each on the project's own loss terms (`learner.losses`).

Tinker's built-in losses are token sums over the whole `forward_backward` batch (its docs,
tinker-docs.thinkingmachines.ai/losses): with lp_t the learner's log-probability of `target_tokens[t]`,
q_t the sampler's (`loss_fn_inputs["logprobs"]`), A_t the advantages and w_t the weights,

    cross_entropy         L = -sum_t w_t lp_t
    importance_sampling   L = -sum_t exp(lp_t - q_t) A_t                         (REINFORCE with IS)
    ppo                   L = -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t),  r_t = exp(lp_t - q_t)
                          (Schulman et al. 2017; lo, hi = loss_fn_config clip_low_threshold /
                          clip_high_threshold, 0.8 / 1.2 by default)

A token sum is the project's 'token-mean' aggregation (`learner.losses.aggregate_loss`) with a global
token count of 1; the policy terms are `learner.losses.ppo_surrogate` (importance sampling: its clip
set to infinity, so the ratio is never clipped; the log-ratio keeps the learner's clamp at
+-LOG_RATIO_CLAMP). Every loss answers `logprobs` (lp) per datum; cross_entropy adds
`elementwise_loss` (-w_t lp_t). A name the SDK knows but this service does not serve yet, and any other
name, is refused by name with the served list (`TINKER_LOSSES[name]`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from kernel.registry import Part, Registry
from learner.losses import Clip, aggregate_loss, ppo_surrogate


@dataclasses.dataclass(frozen=True)
class LossBatch:
    """A `forward_backward` batch, right-padded to `[B, T]`: `mask` is 1 on each datum's tokens."""

    logprobs: torch.Tensor  # the learner's lp of target_tokens (with grad)
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs other than target_tokens, float32 [B, T]
    mask: torch.Tensor


@dataclasses.dataclass(frozen=True)
class LossResult:
    loss: torch.Tensor  # scalar, the batch's token sum
    extra: dict[str, torch.Tensor]  # per-token outputs beside `logprobs`, [B, T]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinkerLoss(Part):
    inputs: tuple[str, ...]  # the loss_fn_inputs it needs besides target_tokens
    config: tuple[str, ...] = ()  # the loss_fn_config keys it reads


def _token_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return aggregate_loss(per_token, mask, "token-mean", global_tokens=1.0)


def cross_entropy(b: LossBatch, config: dict) -> LossResult:
    """-sum_t w_t lp_t (weights default to 1 where not sent)."""
    w = b.inputs.get("weights", torch.ones_like(b.logprobs))
    per_token = -w * b.logprobs
    return LossResult(_token_sum(per_token, b.mask), {"elementwise_loss": per_token.detach()})


def importance_sampling(b: LossBatch, config: dict) -> LossResult:
    """-sum_t exp(lp_t - q_t) A_t: `ppo_surrogate` with an infinite clip."""
    terms = ppo_surrogate(
        b.logprobs, b.inputs["logprobs"], b.inputs["advantages"], b.mask, Clip(low=math.inf)
    )
    return LossResult(_token_sum(terms.per_token, b.mask), {})


def ppo(b: LossBatch, config: dict) -> LossResult:
    """-sum_t min(r_t A_t, clip(r_t, lo, hi) A_t): `ppo_surrogate` with Clip(1 - lo, hi - 1)."""
    lo = float(config.get("clip_low_threshold", 0.8))
    hi = float(config.get("clip_high_threshold", 1.2))
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"ppo needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold (got {lo}, {hi})")
    terms = ppo_surrogate(
        b.logprobs, b.inputs["logprobs"], b.inputs["advantages"], b.mask, Clip(low=1.0 - lo, high=hi - 1.0)
    )
    return LossResult(_token_sum(terms.per_token, b.mask), {})


TINKER_LOSSES: Registry[TinkerLoss] = Registry(
    "Tinker loss",
    "forward_backward loss_fn",
    [
        TinkerLoss(
            name="cross_entropy",
            function=cross_entropy,
            inputs=(),
            summary="-sum w * logprob (supervised); weights optional",
        ),
        TinkerLoss(
            name="importance_sampling",
            function=importance_sampling,
            inputs=("logprobs", "advantages"),
            summary="-sum exp(logprob - sampling logprob) * advantage",
        ),
        TinkerLoss(
            name="ppo",
            function=ppo,
            inputs=("logprobs", "advantages"),
            config=("clip_low_threshold", "clip_high_threshold"),
            summary="-sum min(r A, clip(r, lo, hi) A) (Schulman et al. 2017)",
        ),
    ],
)

Loss = Callable[[LossBatch, dict], LossResult]


def lookup(name: str, inputs: set[str], config: dict) -> Loss:
    """The loss named `name`, its inputs and config keys checked: a ValueError names what is wrong and
    what is allowed (an unknown name lists the served ones)."""
    part = TINKER_LOSSES[name]
    missing = [k for k in part.inputs if k not in inputs]
    if missing:
        raise ValueError(f"loss_fn {name!r} needs loss_fn_inputs {list(part.inputs)} (missing {missing})")
    unknown = sorted(set(config) - set(part.config))
    if unknown:
        raise ValueError(f"loss_fn {name!r} takes loss_fn_config keys {list(part.config)} (got {unknown})")
    return part.function
