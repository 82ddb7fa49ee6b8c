"""One PPO update on one learner rank: pack, proximal pass, targets, whitening, epochs of minibatches.

Every rank runs this concurrently on its own shard; shards may differ in size (even be empty). Ranks
agree on counts with all_reduce and a rank that runs out of data runs zero-weight micro-batches, so
all ranks make the same forward/backward/step calls (ZeRO-3 gathers parameters in every forward).

Loss scaling: each micro-batch loss is divided by the minibatch's GLOBAL token (or sequence) count,
so the micro-batches of all ranks add up to the loss of one big batch. DeepSpeed then averages the
gradients over ranks (and divides by `gradient_accumulation_steps`, which is 1 here and switched off
with `scale_wrt_gas=False`), so each loss is multiplied by the world size before `engine.backward`.

Skipping a bad step: a rank whose micro-batch loss is not finite back-propagates NaN instead. The
ZeRO optimizer computes one global gradient norm over all ranks, finds it invalid, and skips the
step on every rank (no weight, optimizer-state or LR-schedule change) - DeepSpeed's own overflow path.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from learner.advantages import estimate, kl_loss, length_shaped_scores, needs_critic, overlong_filter_mask
from learner.algorithms import (
    aggregate_loss,
    count_sequences,
    entropy_from_logits,
    logprobs_from_logits,
    off_policy_weights,
    policy_loss,
    shape_rewards,
    value_loss,
)
from learner.batch import Batch, Trajectory, dummy_batch, pack_trajectories
from learner.config import LearnerConfig
from learner.critic import (
    RunningMoments,
    critic_stats,
    moments_over_ranks,
    normalized_scores,
    value_clip_radius,
)
from learner.micro_batches import plan_micro_batches
from learner.sequences import pack_rows, response_tokens


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(values: Sequence[float] | torch.Tensor, op: str = "sum", device="cpu") -> torch.Tensor:
    """float64 all_reduce over the learner world (a no-op in a single process without a world)."""
    if isinstance(values, torch.Tensor):
        t = values.detach().to(device=device, dtype=torch.float64).clone()
    else:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if _world() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu()


class Scored(NamedTuple):
    """What one forward gives the PPO loss, in the padded `[B, R]` layout of the micro-batch."""

    logprobs: torch.Tensor  # float32 log-probabilities of the response tokens
    values: torch.Tensor  # float32 values
    entropy: torch.Tensor | None  # per-token entropy (with grad), only when asked for
    logits: torch.Tensor  # the forward's logits ([B, R, V] padded, [K, V] packed)

    @property
    def anchor(self) -> torch.Tensor:
        """Sum of the logits: backward(anchor * 0) reaches every policy parameter (only zero-weight
        and poisoned micro-batches need it, so it is not computed on every forward)."""
        return self.logits.float().sum()


def forward_scores(
    model, b: Batch, temperature: float, extra: int = 0, packed: bool = False, entropy: bool = False
) -> Scored:
    """Log-probabilities and values (and entropies with `entropy`) of the response tokens of `b`.

    With `extra=1` every output has R+1 positions: position `len_i` of row i then holds what the
    state after its last token gives (the value a truncated response bootstraps from). `packed`: one
    padding-free row (`learner.sequences.pack_rows`), outputs only at real response positions."""
    R = b.mask.shape[1] + extra
    if packed:
        counts = b.mask.sum(1).long() + extra
        rows = pack_rows(b.input_ids.cpu(), b.attention_mask.cpu(), b.prompt_lens.cpu(), counts.cpu(), R)
        rows = rows.to(b.input_ids.device)
        logits, values = model(None, None, None, R, temperature, packed=rows)
        tokens, place = rows.targets, rows.unpack  # outputs back into the padded layout
    else:
        logits, values = model(b.input_ids, b.attention_mask, b.prompt_lens, R, temperature)
        tokens, place = response_tokens(b.input_ids, b.prompt_lens, R), _as_is
    ent = place(entropy_from_logits(logits)) if entropy else None
    return Scored(place(logprobs_from_logits(logits, tokens)), place(values.float()), ent, logits)


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def _micro_batches(batch: Batch, idx: torch.Tensor, config: LearnerConfig) -> list[torch.Tensor]:
    """Rows `idx` of `batch` cut by count or under the token budget (`learner.micro_batches`)."""
    lengths = batch.attention_mask[idx].sum(1).tolist()
    plan = plan_micro_batches(
        lengths,
        max_rows=config.micro_batch_size,
        max_tokens=config.max_tokens_per_micro_batch,
        packed=config.pack_sequences,
    )
    return [idx[torch.tensor(members, dtype=torch.long)] for members in plan]


@torch.no_grad()
def proximal_pass(engine, batch: Batch, config: LearnerConfig, temperature: float, pad_id: int, device):
    """No-grad `old_logprobs` and `values` `[B, R]` of the shard, in micro-batches (same count on all ranks),
    and `[B]` values of the state after each row's last token (the bootstrap of a truncated response).

    Values are 0 when the estimator has no critic; the bootstrap values are only computed (one more
    output position) with truncation='bootstrap'."""
    micro = _micro_batches(batch, torch.arange(len(batch)), config)
    n = int(all_reduce([len(micro)], "max", device)[0])
    critic = needs_critic(config.advantage)
    extra = int(critic and config.truncation == "bootstrap")
    B, R = batch.mask.shape
    old_lp = torch.zeros((B, R), dtype=torch.float32)
    values = torch.zeros((B, R + extra), dtype=torch.float32)
    for i in range(n):
        if i < len(micro):
            mb = batch.take(micro[i])
            lp, v, _, _ = forward_scores(engine, mb.to(device), temperature, extra, config.pack_sequences)
            r = mb.mask.shape[1]
            old_lp[micro[i], :r] = lp[:, :r].cpu()
            if critic:
                values[micro[i], : r + extra] = v.cpu()
        else:
            forward_scores(engine, dummy_batch(pad_id).to(device), temperature, 0, config.pack_sequences)
    lengths = batch.mask.sum(-1).long()
    boot = values.gather(1, lengths.clamp(max=R + extra - 1).unsqueeze(1)).squeeze(1) if extra else None
    return old_lp, values[:, :R], boot


def distributed_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, device="cpu"
) -> torch.Tensor:
    """`algorithms.masked_whiten` over the valid tokens of ALL ranks' shards (two-pass, float64)."""
    count, mean, m2 = moments_over_ranks(x, mask, functools.partial(all_reduce, op="sum", device=device))
    sq = m2 / max(count, 1.0)
    var = sq * count / (count - 1) if count >= 2 else sq
    out = (x.double() - mean) / math.sqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.to(torch.bool), out, torch.zeros((), dtype=torch.float64)).to(x.dtype)


def prepare(
    engine,
    batch: Batch,
    config: LearnerConfig,
    kl_coef: float,
    temperature: float,
    pad_id: int,
    device,
    reward_moments: RunningMoments | None = None,
) -> dict[str, float]:
    """Proximal pass, shaped rewards, advantages by `config.advantage`, global whitening. Fills
    `batch.tokens`; returns global stats."""
    old_lp, values, boot = proximal_pass(engine, batch, config, temperature, pad_id, device)
    mask = batch.mask
    reduce_sum = functools.partial(all_reduce, op="sum", device=device)
    truncated = batch.truncated if batch.truncated is not None else torch.zeros(len(batch), dtype=torch.bool)
    lengths = mask.sum(-1)
    # missing_eos_penalty and the overlong ramp add (learner.advantages.length_shaped_scores)
    penalized, overlong = length_shaped_scores(
        batch.scores,
        truncated,
        lengths,
        eos_penalty=config.missing_eos_penalty,
        max_tokens=config.overlong_max_tokens,
        buffer=config.overlong_buffer,
        factor=config.overlong_penalty,
    )
    scores, norm_stats = normalized_scores(penalized, config, reward_moments, reduce_sum)
    beta = kl_coef if config.kl.mode == "reward" else 0.0
    rewards, kl = shape_rewards(scores, old_lp, batch.tokens["ref_logprobs"], mask, beta, config.kl.estimator)
    adv, returns = estimate(
        config.advantage,
        scores=scores,
        rewards=rewards,
        values=values,
        mask=mask,
        gamma=config.gamma,
        lam=config.lam,
        groups=batch.groups,
        log_rho=old_lp - batch.tokens["behaviour_logprobs"],
        bootstrap=None if boot is None else torch.where(truncated, boot, torch.zeros_like(boot)),
        group_std=config.group_std_normalize,
        rho_clip=config.vtrace_rho_clip,
        c_clip=config.vtrace_c_clip,
        whiten=lambda x, m: distributed_whiten(x, m, shift_mean=True, device=device),
    )
    valid = mask.to(torch.bool)
    gap = torch.where(valid, (old_lp - batch.tokens["behaviour_logprobs"]).abs(), torch.zeros(()))
    local = [
        mask.sum(),  # tokens
        float(len(batch)),  # sequences
        batch.scores.sum(),
        kl.sum(),  # per-sequence sums, summed
        gap.sum(),
        (values * mask).sum(),
        (returns * mask).sum(),
        (adv * mask).sum(),
        overlong.sum(),
        float(truncated.sum()) if config.overlong_filter else 0.0,  # samples filtered out of the loss
        (mask * truncated.unsqueeze(-1)).sum() if config.overlong_filter else 0.0,  # their tokens
        float(_overlong_mismatch(lengths, truncated, config)),
    ]
    g = all_reduce(local, "sum", device).tolist()
    if g[11] > 0:  # the same global count on every rank: all ranks stop here together
        raise ValueError(
            f"learner.overlong_max_tokens={config.overlong_max_tokens} is not rollout.sampling.max_new_tokens: "
            f"{int(g[11])} sample(s) were longer, or truncated at another length"
        )
    tokens, seqs = max(g[0], 1.0), max(g[1], 1.0)
    stats = {
        "train/tokens": g[0] - g[10],
        "train/sequences": g[1],
        "rollout/reward_mean": g[2] / seqs,
        "objective/kl": g[3] / seqs,
        "rollout/logprob_gap": g[4] / tokens,
        "values/mean": g[5] / tokens,
        "returns/mean": g[6] / tokens,
        "advantages/mean": g[7] / tokens,
    }
    if config.overlong_buffer > 0:
        stats["train/overlong_penalty_mean"] = g[8] / seqs
    if config.overlong_filter:
        stats["train/overlong_filtered"] = g[9]
    stats.update(norm_stats)
    stats.update(critic_stats(values, returns, mask, reduce_sum))
    if config.value_clip == "relative":
        radius = value_clip_radius("relative", config.value_clip_eps, stats["returns/std"])
        batch.tokens["value_clip"] = torch.full_like(returns, radius)
        stats["values/clip_radius"] = radius
    if config.whiten_advantages and needs_critic(config.advantage):
        adv = distributed_whiten(adv, mask, shift_mean=True, device=device)
    batch.tokens.update(old_logprobs=old_lp, old_values=values, advantages=adv, returns=returns)
    if config.off_policy not in ("none", "auto"):  # 'auto' is resolved by the run config
        w, _ = off_policy_weights(
            old_lp,
            batch.tokens["behaviour_logprobs"],
            mask,
            config.off_policy,
            config.off_policy_cap,
            config.off_policy_geo_bounds,
        )
        batch.tokens["is_weights"] = w
    stats.update(_off_policy_stats(old_lp, batch.tokens["behaviour_logprobs"], mask, config, device))
    if config.overlong_filter:
        # DAPO overlong filtering: from here on (the PPO epochs) a truncated row has no valid token, so it
        # adds nothing to any loss term nor to the global token/sequence counts the losses divide by.
        batch.mask = overlong_filter_mask(mask, truncated)
    return stats


def _overlong_mismatch(lengths: torch.Tensor, truncated: torch.Tensor, config: LearnerConfig) -> int:
    """Samples that show learner.overlong_max_tokens is not the workers' max_new_tokens: longer than it, or
    truncated (which the workers do exactly at max_new_tokens) at another length. 0 when the ramp is off."""
    if config.overlong_buffer == 0:
        return 0
    L = config.overlong_max_tokens
    return int(((lengths > L) | (truncated & (lengths != L))).sum())


def _off_policy_stats(old_lp, behaviour, mask, config: LearnerConfig, device) -> dict[str, float]:
    """Global off-policy weight statistics (over all ranks' valid tokens), also when no correction is on."""
    mode = "none" if config.off_policy == "auto" else config.off_policy
    w, m = off_policy_weights(
        old_lp, behaviour, mask, mode, config.off_policy_cap, config.off_policy_geo_bounds
    )
    n = float(mask.sum())
    g = all_reduce([m["weight_mean"] * n, m["clipped_frac"] * n, m["behaviour_kl"] * n, n], "sum", device)
    mx = float(all_reduce([m["weight_max"]], "max", device)[0])
    tokens = max(float(g[3]), 1.0)
    return {
        "off_policy/weight_mean": float(g[0]) / tokens,
        "off_policy/weight_max": mx,
        "off_policy/clipped_frac": float(g[1]) / tokens,
        "off_policy/behaviour_kl": float(g[2]) / tokens,
    }


def micro_batch_loss(
    engine, mb: Batch, config: LearnerConfig, temperature: float, g_tokens: float, g_seqs: float
):
    """The PPO loss of one micro-batch, normalised by the minibatch's global counts, and its local metrics."""
    with_entropy = config.entropy_coef > 0  # else the sampled tokens' -log pi estimates it, for free
    scored = forward_scores(engine, mb, temperature, 0, config.pack_sequences, entropy=with_entropy)
    logprobs, values = scored.logprobs, scored.values
    t, agg = mb.tokens, config.loss_agg
    pg, pg_m = policy_loss(
        logprobs,
        t["old_logprobs"],
        t["advantages"],
        mb.mask,
        clip_eps=config.clip_eps,
        clip_eps_high=config.clip_eps_high,
        dual_clip=config.dual_clip,
        is_weights=t.get("is_weights"),
        agg=agg,
        global_tokens=g_tokens,
        global_seqs=g_seqs,
    )
    if needs_critic(config.advantage):
        vclip = None if config.value_clip == "off" else t.get("value_clip", config.value_clip_eps)
        vf, vf_m = value_loss(values, t["old_values"], t["returns"], mb.mask, vclip, agg, g_tokens, g_seqs)
    else:  # no critic: no value loss (the value head is frozen, see LearnerRank.setup)
        vf, vf_m = torch.zeros((), device=logprobs.device), {"clip_frac": 0.0}
    if with_entropy:
        ent = aggregate_loss(scored.entropy, mb.mask, agg, g_tokens, g_seqs)
    else:
        ent = aggregate_loss(-logprobs.detach(), mb.mask, agg, g_tokens, g_seqs)
    loss = pg + config.vf_coef * vf - config.entropy_coef * ent
    if config.kl.mode == "loss":
        kl_term = kl_loss(logprobs, t["ref_logprobs"], config.kl.loss_estimator)
        loss = loss + config.kl.loss_coef * aggregate_loss(kl_term, mb.mask, agg, g_tokens, g_seqs)
    n = float(mb.mask.sum())
    local = [
        float(pg.detach()),
        float(vf.detach()),
        float(ent.detach()),
        pg_m["approx_kl"] * n,
        pg_m["clip_frac"] * n,
        vf_m["clip_frac"] * n,
        n,
        pg_m["log_ratio_clamped"],
    ]
    return loss, scored, local


def ppo_update(
    engine, batch: Batch, config: LearnerConfig, temperature: float, pad_id: int, device, generator
):
    """PPO epochs x minibatches x micro-batches on this rank; one optimizer step per minibatch on all ranks."""
    world = _world()
    n_local = len(batch)
    sums = torch.zeros(8, dtype=torch.float64)  # pg, vf, ent, kl*n, clip*n, vclip*n, n, clamped (applied)
    applied, skipped, empty, grad_norm = 0, 0, 0, 0.0
    zero_w = dummy_batch(pad_id).to(device)
    for _ in range(config.ppo_epochs):
        perm = torch.randperm(n_local, generator=generator)
        minibatches = list(torch.tensor_split(perm, config.num_minibatches))
        micro = [_micro_batches(batch, mb, config) for mb in minibatches]
        k = len(minibatches)
        n_micro = all_reduce([float(len(m)) for m in micro], "max", device).long().tolist()
        local_counts = [float(batch.mask[mb].sum()) for mb in minibatches] + [
            count_sequences(batch.mask[mb]) for mb in minibatches
        ]
        counts = all_reduce(local_counts, "sum", device).tolist()  # k token counts, then k sequence counts
        for j in range(k):
            if n_micro[j] == 0:  # no rank has data for this minibatch (fewer sequences than minibatches)
                continue
            if counts[j] == 0:
                # no token left in the loss on any rank (every sample overlong-filtered): the loss is 0 and
                # a step on zero gradients would still move the weights (Adam's moments, weight decay)
                empty += 1
                continue
            step_sums = torch.zeros(8, dtype=torch.float64)
            poisoned = False
            for i in range(n_micro[j]):
                engine.set_gradient_accumulation_boundary(i == n_micro[j] - 1)
                if i < len(micro[j]):
                    mb = batch.take(micro[j][i]).to(device)
                    loss, scored, local = micro_batch_loss(
                        engine, mb, config, temperature, counts[j], counts[k + j]
                    )
                    if torch.isfinite(loss):
                        engine.backward(loss * world, scale_wrt_gas=False)
                        step_sums += torch.tensor(local, dtype=torch.float64)
                        continue
                    poisoned = True
                    scale = float("nan")
                else:
                    scored = forward_scores(engine, zero_w, temperature, 0, config.pack_sequences)
                    scale = 0.0
                # Built from the outputs so every parameter gets a gradient (0, or NaN to force a skip),
                # through the same modules as a real micro-batch: the (frozen) value head only with a
                # critic, or ZeRO-3 would gather it in this backward alone and the ranks' collectives differ.
                out = scored.anchor + (scored.values.sum() if needs_critic(config.advantage) else 0.0)
                engine.backward(out * scale, scale_wrt_gas=False)
            engine.step()
            if engine.was_step_applied():
                if poisoned:
                    raise RuntimeError(
                        "DeepSpeed applied an optimizer step whose gradients were NaN on purpose"
                    )
                applied += 1
                sums += step_sums
                grad_norm += float(engine.get_global_grad_norm() or 0.0)
            else:
                skipped += 1
    tot = all_reduce(sums, "sum", device).tolist()
    steps, n = max(applied, 1), max(tot[6], 1.0)
    # no step taken: NaN, unless only because no minibatch had a token to train (a loss of 0, not a failure)
    nan = 0.0 if empty and not skipped else float("nan")
    return {
        "loss/policy": tot[0] / steps if applied else nan,
        "loss/value": tot[1] / steps if applied else nan,
        "loss/entropy": tot[2] / steps if applied else nan,
        "params/approx_kl": tot[3] / n if applied else nan,
        "params/policy_clip_frac": tot[4] / n if applied else nan,
        "params/value_clip_frac": tot[5] / n if applied else nan,
        "params/grad_norm": grad_norm / steps if applied else nan,
        "train/log_ratio_clamped_tokens": tot[7],
        "train/skipped_steps": float(skipped),
        "train/optimizer_steps": float(applied),
    }


def train_step(
    engine,
    trajectories: Sequence[Trajectory],
    config: LearnerConfig,
    kl_controller,
    temperature: float,
    pad_id: int,
    generator: torch.Generator,
    reward_moments: RunningMoments | None = None,
) -> dict[str, float]:
    """One PPO iteration on this rank's shard; every returned metric is global (identical on all ranks).

    `reward_moments`: the running score statistics `learner.reward_norm` normalises with (updated here).
    """
    start = time.perf_counter()
    device = engine.device
    engine.train()
    batch = pack_trajectories(trajectories, pad_id)
    kl_coef = float(kl_controller.value)
    stats = prepare(engine, batch, config, kl_coef, temperature, pad_id, device, reward_moments)
    metrics = ppo_update(engine, batch, config, temperature, pad_id, device, generator)
    if math.isfinite(stats["objective/kl"]) and stats["train/sequences"] > 0:
        kl_controller.update(stats["objective/kl"], int(stats["train/sequences"]))
    metrics.update(stats)
    metrics["objective/kl_coef"] = kl_coef if config.kl.mode == "reward" else config.kl.loss_coef
    metrics["time/train"] = float(all_reduce([time.perf_counter() - start], "max", device)[0])
    return metrics
