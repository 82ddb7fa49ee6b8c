"""The `loss_fn` names of the Tinker API, each on the project's own loss terms (`learner.losses`).

Tinker's built-in losses are token sums over the whole `forward_backward` batch (its docs,
tinker-docs.thinkingmachines.ai/losses): with lp_t the learner's log-probability of `target_tokens[t]`,
q_t the sampler's (`loss_fn_inputs["logprobs"]`), A_t the advantages and w_t the weights,

    cross_entropy         L = -sum_t w_t lp_t
    importance_sampling   L = -sum_t exp(lp_t - q_t) A_t                         (REINFORCE with IS)
    ppo                   L = -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t),  r_t = exp(lp_t - q_t)
                          (Schulman et al. 2017; lo, hi = loss_fn_config clip_low_threshold /
                          clip_high_threshold, 0.8 / 1.2 by default)
    cispo                 L = -sum_t sg(clip(r_t, lo, hi)) lp_t A_t  (MiniMax-M1; `learner.losses.
                          cispo_surrogate`, the learner's policy_loss 'cispo')
    gspo                  L = -sum_t min(s_t A_t, clip(s_t, lo, hi) A_t), s_t = sg(s) pi_t / sg(pi_t),
                          s = exp(mean_{t in M} (lp_t - q_t)) per datum (GSPO-token, Zheng et al. 2025;
                          `learner.losses.gspo_surrogate`, the learner's policy_loss 'gspo'); M is the
                          optional `sequence_ratio_mask`'s nonzero tokens, else all the datum's tokens

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
from learner.losses import Clip, aggregate_loss, cispo_surrogate, gspo_surrogate, ppo_surrogate


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
    optional: tuple[str, ...] = ()  # those it reads when sent
    config: tuple[str, ...] = ()  # the loss_fn_config keys it reads


def _token_sum(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return aggregate_loss(per_token, mask, "token-mean", global_tokens=1.0)


def _clip(config: dict, name: str) -> Clip:
    lo = float(config.get("clip_low_threshold", 0.8))
    hi = float(config.get("clip_high_threshold", 1.2))
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"{name} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold (got {lo}, {hi})")
    return Clip(low=1.0 - lo, high=hi - 1.0)


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
    terms = ppo_surrogate(
        b.logprobs, b.inputs["logprobs"], b.inputs["advantages"], b.mask, _clip(config, "ppo")
    )
    return LossResult(_token_sum(terms.per_token, b.mask), {})


def cispo(b: LossBatch, config: dict) -> LossResult:
    """-sum_t sg(clip(r_t, lo, hi)) lp_t A_t: the learner's `cispo_surrogate`, token-summed."""
    terms = cispo_surrogate(
        b.logprobs, b.inputs["logprobs"], b.inputs["advantages"], b.mask, _clip(config, "cispo")
    )
    return LossResult(_token_sum(terms.per_token, b.mask), {})


def gspo(b: LossBatch, config: dict) -> LossResult:
    """GSPO-token, token-summed: the learner's `gspo_surrogate` with its sequence ratio over M (the
    `sequence_ratio_mask` when sent). A token outside M with a non-zero advantage is refused: its term
    would need the sequence's ratio without being part of it, which the learner's form does not define."""
    m = b.mask
    if "sequence_ratio_mask" in b.inputs:
        m = b.mask * (b.inputs["sequence_ratio_mask"] != 0).to(b.mask.dtype)
        outside = (b.mask - m).bool() & (b.inputs["advantages"] != 0)
        if bool(outside.any()):
            raise ValueError(
                "gspo: tokens outside sequence_ratio_mask carry non-zero advantages (not served)"
            )
    terms = gspo_surrogate(b.logprobs, b.inputs["logprobs"], b.inputs["advantages"], m, _clip(config, "gspo"))
    return LossResult(_token_sum(terms.per_token, m), {})


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
        TinkerLoss(
            name="cispo",
            function=cispo,
            inputs=("logprobs", "advantages"),
            config=("clip_low_threshold", "clip_high_threshold"),
            summary="-sum sg(clip(r, lo, hi)) * logprob * advantage (MiniMax-M1)",
        ),
        TinkerLoss(
            name="gspo",
            function=gspo,
            inputs=("logprobs", "advantages"),
            optional=("sequence_ratio_mask",),
            config=("clip_low_threshold", "clip_high_threshold"),
            summary="-sum min(s A, clip(s, lo, hi) A), s the datum's geometric-mean ratio (GSPO-token)",
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
