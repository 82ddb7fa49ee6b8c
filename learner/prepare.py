"""The first phase of a PPO step on one learner rank: what the epochs train on, computed once per batch.

The no-grad proximal pass (old log-probabilities and values), the length-shaped and normalised scores,
the KL-shaped rewards, advantages and returns by `learner.advantage`, whitening over all ranks' valid
tokens, the off-policy weights, and the batch's global statistics. Every rank runs it concurrently on its
own shard; the counts, sums and moments are all_reduced, so every returned statistic is global.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from kernel.moe_routing import NOT_RECORDED, moe_routers, record_routing
from learner.advantages import (
    AdvantageInputs,
    AdvantageParams,
    estimate,
    length_shaped_scores,
    needs_critic,
    overlong_filter_mask,
    place_token_rewards,
)
from learner.algorithms import episode_return, shape_rewards, whiten_with
from learner.batch import Batch, dummy_batch
from learner.config import LearnerConfig
from learner.context import LearnerContext
from learner.corrections import Correction, CorrectionSums, correction_weights, from_config
from learner.critic import (
    critic_stats,
    moments_over_ranks,
    normalized_rewards,
    value_clip_radius,
)
from learner.forward import (
    RankSums,
    all_reduce,
    forward_scores,
    keep_routing,
    micro_batch_rows,
    replays_routing,
)
from learner.lora import adapters_off


@torch.no_grad()
def proximal_pass(ctx: LearnerContext, batch: Batch):
    """No-grad `old_logprobs` and `values` `[B, R]` of the shard, in micro-batches (same count on all ranks),
    and `[B]` values of the state after each row's last token (the bootstrap of a truncated response).

    Values are 0 when the estimator has no critic; the bootstrap values are only computed (one more
    output position) with truncation='bootstrap'. With learner.reference_from_base each micro-batch
    also gets a second forward with the LoRA adapters off: the reference logprobs, filled into
    `batch.tokens.ref_logprobs` (the frozen initial policy is the base weights the adapters sit on)."""
    replays_routing(ctx.config, batch, proximal=True)  # refuses R3 without routing before anything runs
    engine, config, temperature, pad_id, device = (
        ctx.engine,
        ctx.config,
        ctx.temperature,
        ctx.pad_id,
        ctx.device,
    )
    micro = micro_batch_rows(batch, torch.arange(len(batch)), config)
    n = int(all_reduce([len(micro)], "max", device)[0])
    critic = needs_critic(config.advantage)
    extra = int(critic and config.truncation == "bootstrap")
    B, R = batch.mask.shape
    old_lp = torch.zeros((B, R), dtype=torch.float32)
    values = torch.zeros((B, R + extra), dtype=torch.float32)
    from_base = config.reference_from_base
    replay = replays_routing(config, batch, proximal=True)
    own = config.router_replay == "R2"  # keep this pass's routing for the PPO passes
    if own and not moe_routers(engine):
        raise ValueError(
            "learner.router_replay='R2' needs a mixture-of-experts policy; this one has no MoE layer"
        )
    routes = None
    ref_lp = torch.zeros((B, R), dtype=torch.float32) if from_base else None
    for i in range(n):
        if i < len(micro):
            mb = batch.take(micro[i])
            with record_routing(engine) if own else contextlib.nullcontext() as taken:
                lp, v, _ = forward_scores(
                    engine, mb.to(device), temperature, extra, config.pack_sequences, replay=replay
                )
            if own:
                if routes is None:
                    k = taken[0][0].shape[-1]
                    routes = torch.full(
                        (B, batch.input_ids.shape[1], len(taken), k), NOT_RECORDED, dtype=torch.uint8
                    )
                keep_routing(routes, micro[i], mb, taken, config.pack_sequences)
            r = mb.mask.shape[1]
            old_lp[micro[i], :r] = lp[:, :r].cpu()
            if from_base:
                with adapters_off(engine.module):
                    base, _, _ = forward_scores(
                        engine, mb.to(device), temperature, 0, config.pack_sequences, replay=replay
                    )
                ref_lp[micro[i], :r] = base[:, :r].cpu()
            if critic:
                values[micro[i], : r + extra] = v.cpu()
        else:  # as many forwards as the other ranks (ZeRO-3 gathers parameters in each)
            forward_scores(engine, dummy_batch(pad_id).to(device), temperature, 0, config.pack_sequences)
            if from_base:
                with adapters_off(engine.module):
                    forward_scores(
                        engine, dummy_batch(pad_id).to(device), temperature, 0, config.pack_sequences
                    )
    if own and routes is not None:
        batch.routing = routes
    if from_base:
        if len(batch) and batch.tokens.ref_logprobs is not None:
            raise ValueError(
                "learner.reference_from_base computes the reference logprobs here, but the trajectories carry "
                "their own: the reference comes from one place"
            )
        batch.tokens.ref_logprobs = ref_lp
    elif batch.tokens.ref_logprobs is None:
        raise ValueError(
            "the trajectories carry no reference logprobs: a reference role computes them, or "
            "learner.reference_from_base (LoRA) computes them here"
        )
    lengths = batch.response_lens
    boot = values.gather(1, lengths.clamp(max=R + extra - 1).unsqueeze(1)).squeeze(1) if extra else None
    return old_lp, values[:, :R], boot


def distributed_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, device="cpu"
) -> torch.Tensor:
    """`algorithms.masked_whiten` over the valid tokens of ALL ranks' shards (two-pass moments, float64)."""
    count, mean, m2 = moments_over_ranks(x, mask, functools.partial(all_reduce, op="sum", device=device))
    sq = m2 / max(count, 1.0)
    var = sq * count / (count - 1) if count >= 2 else sq
    return whiten_with(x.double(), mask, mean, var, shift_mean).to(x.dtype)


def advantage_params(config: LearnerConfig, device) -> AdvantageParams:
    """The estimator's settings from the config: gamma and the selected estimator's parameter block
    (`learner.<advantage>`, its fields named as `AdvantageParams`'); reinforce_pp whitens over every
    rank's tokens."""
    block = config.params(config.advantage)
    return AdvantageParams(
        gamma=config.gamma,
        whiten=lambda x, m: distributed_whiten(x, m, shift_mean=True, device=device),
        **({} if block is None else block.model_dump()),
    )


@dataclasses.dataclass
class BatchSums(RankSums):
    """The prepared batch's statistics as sums over this rank's rows (then over the ranks)."""

    tokens: float = 0.0  # valid response tokens
    sequences: float = 0.0
    reward: float = 0.0  # sum of the sequences' returns (raw: before length shaping and reward_norm)
    kl: float = 0.0  # per-sequence KL sums, summed
    logprob_gap: float = 0.0  # sum over tokens of |proximal - behaviour| logprob
    values: float = 0.0  # sums over valid tokens
    returns: float = 0.0
    advantages: float = 0.0
    overlong_penalty: float = 0.0
    filtered_samples: float = 0.0  # overlong filter: truncated samples dropped from the loss
    filtered_tokens: float = 0.0  # and their tokens
    overlong_mismatch: float = 0.0  # samples showing overlong_max_tokens is not max_new_tokens


def prepare(ctx: LearnerContext, batch: Batch, kl_coef: float, bypass: bool = False) -> dict[str, float]:
    """Proximal pass, shaped rewards, advantages by `config.advantage`, global whitening. Fills
    `batch.tokens`; returns global stats (and updates `ctx.reward_moments` under learner.reward_norm).
    `bypass` (`learner.bypass`: every rank alike): the behaviour logprobs are the old logprobs and the
    proximal pass is skipped; the engine-learner gap is then not measured (NaN)."""
    config, device, reward_moments = ctx.config, ctx.device, ctx.reward_moments
    if bypass:
        old_lp = batch.tokens.behaviour_logprobs.clone()
        values, boot = torch.zeros_like(old_lp), None
    else:
        old_lp, values, boot = proximal_pass(ctx, batch)
    mask = batch.mask
    reduce_sum = functools.partial(all_reduce, op="sum", device=device)
    truncated = batch.truncated if batch.truncated is not None else torch.zeros(len(batch), dtype=torch.bool)
    lengths = batch.response_lens.to(mask.dtype)
    # missing_eos_penalty and the overlong ramp add (learner.advantages.length_shaped_scores)
    penalized, overlong = length_shaped_scores(
        batch.scores,
        truncated,
        lengths,
        eos_penalty=config.missing_eos_penalty,
        max_tokens=config.overlong.max_tokens,
        buffer=config.overlong.buffer,
        factor=config.overlong.penalty,
    )
    raw_turns = batch.tokens.token_rewards  # earlier turns of multi-turn episodes
    scores, turns, norm_stats = normalized_rewards(
        penalized, config, reward_moments, reduce_sum, raw_turns, mask
    )
    beta = kl_coef if config.kl.mode == "reward" else 0.0
    rewards, kl = shape_rewards(scores, old_lp, batch.tokens.ref_logprobs, mask, beta, config.kl.estimator)
    if turns is not None:
        rewards, scores = place_token_rewards(config.advantage, rewards, scores, turns, mask)
    inputs = AdvantageInputs(
        scores=scores,
        rewards=rewards,
        values=values,
        mask=mask,
        groups=batch.groups,
        log_rho=old_lp - batch.tokens.behaviour_logprobs,
        bootstrap=None if boot is None else torch.where(truncated, boot, torch.zeros_like(boot)),
    )
    adv, returns = estimate(config.advantage, inputs, advantage_params(config, device))
    raw_returns = batch.scores if raw_turns is None else episode_return(batch.scores, raw_turns, mask)
    valid = mask.to(torch.bool)
    gap = torch.where(valid, (old_lp - batch.tokens.behaviour_logprobs).abs(), torch.zeros(()))
    g = BatchSums(
        tokens=float(mask.sum()),
        sequences=float(len(batch)),
        reward=float(raw_returns.sum()),
        kl=float(kl.sum()),  # per-sequence sums, summed
        logprob_gap=float(gap.sum()),
        values=float((values * mask).sum()),
        returns=float((returns * mask).sum()),
        advantages=float((adv * mask).sum()),
        overlong_penalty=float(overlong.sum()),
        filtered_samples=float(truncated.sum()) if config.overlong.filter else 0.0,
        filtered_tokens=float((mask * truncated.unsqueeze(-1)).sum()) if config.overlong.filter else 0.0,
        overlong_mismatch=float(_overlong_mismatch(lengths, truncated, config)),
    ).all_reduced(device)
    if g.overlong_mismatch > 0:  # the same global count on every rank: all ranks stop here together
        raise ValueError(
            f"learner.overlong.max_tokens={config.overlong.max_tokens} is not rollout.sampling.max_new_tokens: "
            f"{int(g.overlong_mismatch)} sample(s) were longer, or truncated at another length"
        )
    tokens, seqs = max(g.tokens, 1.0), max(g.sequences, 1.0)
    stats = {
        "train/tokens": g.tokens - g.filtered_tokens,
        "train/sequences": g.sequences,
        "train/reward_mean": g.reward / seqs,
        "objective/kl": g.kl / seqs,
        "rollout/logprob_gap": math.nan if bypass else g.logprob_gap / tokens,
        "values/mean": g.values / tokens,
        "returns/mean": g.returns / tokens,
        "advantages/mean": g.advantages / tokens,
    }
    if config.overlong.buffer > 0:
        stats["train/overlong_penalty_mean"] = g.overlong_penalty / seqs
    if config.overlong.filter:
        stats["train/overlong_filtered"] = g.filtered_samples
    stats.update(norm_stats)
    stats.update(critic_stats(values, returns, mask, reduce_sum))
    if config.value_clip == "relative":
        radius = value_clip_radius("relative", config.value_clip_eps, stats["returns/std"])
        batch.tokens.value_clip = torch.full_like(returns, radius)
        stats["values/clip_radius"] = radius
    if config.whiten_advantages and needs_critic(config.advantage):
        adv = distributed_whiten(adv, mask, shift_mean=True, device=device)
    t = batch.tokens
    t.old_logprobs, t.old_values, t.advantages, t.returns = old_lp, values, adv, returns
    # One computation of the rollout-correction weights, for the loss (applied unless the correction is
    # 'none') and for the mismatch metrics (reported in every mode). 'auto' was decided by the run config;
    # here it reads as 'none' (learner.corrections.from_config).
    correction = from_config(config)
    weights, sums, weight_max = correction_weights(old_lp, batch.tokens.behaviour_logprobs, mask, correction)
    if correction != Correction():
        batch.tokens.is_weights = weights
    stats.update(_correction_stats(sums, weight_max, device, measured=not bypass))
    if config.overlong.filter:
        # DAPO overlong filtering: from here on (the PPO epochs) a truncated row has no valid token, so it
        # adds nothing to any loss term nor to the global token/sequence counts the losses divide by.
        batch.mask = overlong_filter_mask(mask, truncated)
    return stats


def _overlong_mismatch(lengths: torch.Tensor, truncated: torch.Tensor, config: LearnerConfig) -> int:
    """Samples that show learner.overlong.max_tokens is not the workers' max_new_tokens: longer than it, or
    truncated (which the workers do exactly at max_new_tokens) at another length. 0 when the ramp is off."""
    if config.overlong.buffer == 0:
        return 0
    L = config.overlong.max_tokens
    return int(((lengths > L) | (truncated & (lengths != L))).sum())


def _correction_stats(sums: CorrectionSums, weight_max: float, device, measured: bool) -> dict[str, float]:
    """The step's rollout-correction and mismatch metrics over all ranks' valid tokens, from this rank's
    `sums`. On a bypassed step (not `measured`) pi_prox is mu by construction: the mismatch is NaN there."""
    g = CorrectionSums(*(float(x) for x in all_reduce(list(dataclasses.astuple(sums)), "sum", device)))
    mx = float(all_reduce([weight_max], "max", device)[0])
    out = g.metrics(mx)
    if not measured:
        for name in ("off_policy/behaviour_kl", "off_policy/behaviour_kl_k1", "off_policy/ppl_ratio"):
            out[name] = math.nan
    return out
