"""One PPO update on one learner rank: pack the shard, `learner.prepare` it, then epochs of minibatches.

Every rank runs this concurrently on its own shard; shards may differ in size (even be empty). Ranks
agree on counts with all_reduce and a rank that runs out of data runs zero-weight micro-batches, so
all ranks make the same forward/backward/step calls (ZeRO-3 gathers parameters in every forward).

Loss scaling: each micro-batch loss is divided by the minibatch's GLOBAL token (or sequence) count,
so the micro-batches of all ranks add up to the loss of one big batch. DeepSpeed then averages the
gradients over ranks (and divides by `gradient_accumulation_steps`, which is 1 here and switched off
with `scale_wrt_gas=False`), so each loss is multiplied by the world size before `engine.backward`.

Skipping a bad step: a rank whose micro-batch loss is not finite back-propagates NaN instead. The
ZeRO optimizer computes one global gradient norm over all ranks, finds it invalid, and skips the
step on every rank (no weight or optimizer-state change) - DeepSpeed's own overflow path. The LR
schedule's clock still moves on by that slot (learner.lr_schedule), as for a minibatch with no token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import torch

from kernel.metric_names import merge_metrics
from learner.advantages import kl_loss, needs_critic
from learner.algorithms import count_sequences
from learner.batch import Batch, Trajectory, dummy_batch, pack_trajectories
from learner.context import LearnerContext
from learner.forward import (
    RankSums,
    all_reduce,
    anchored_backward,
    forward_scores,
    micro_batch_rows,
    replays_routing,
    world_size,
)
from learner.losses import aggregate_loss, policy_loss, value_loss
from learner.lr_schedule import advance_unapplied
from learner.prepare import prepare


@dataclasses.dataclass
class UpdateSums(RankSums):
    """The update's statistics as sums: over the micro-batches of a step, then over the applied steps,
    then (`all_reduce`) over the ranks. The losses are each micro-batch's share of its minibatch's loss
    (normalised by the global counts); the per-token rates are weighted by the micro-batch's tokens."""

    policy_loss: float = 0.0
    value_loss: float = 0.0
    entropy: float = 0.0
    approx_kl: float = 0.0  # x tokens
    policy_clip_frac: float = 0.0  # x tokens
    value_clip_frac: float = 0.0  # x tokens
    tokens: float = 0.0
    log_ratio_clamped: float = 0.0  # tokens whose log-ratio hit the clamp

    def metrics(self, applied: int, grad_norm: float, no_step: float) -> dict[str, float]:
        """Means per applied step (losses, `grad_norm` the sum of the applied steps' norms) and per token
        (rates); `no_step` in their place when no step was applied."""
        steps, n = max(applied, 1), max(self.tokens, 1.0)
        return {
            "loss/policy": self.policy_loss / steps if applied else no_step,
            "loss/value": self.value_loss / steps if applied else no_step,
            "loss/entropy": self.entropy / steps if applied else no_step,
            "params/approx_kl": self.approx_kl / n if applied else no_step,
            "params/policy_clip_frac": self.policy_clip_frac / n if applied else no_step,
            "params/value_clip_frac": self.value_clip_frac / n if applied else no_step,
            "params/grad_norm": grad_norm / steps if applied else no_step,
            "train/log_ratio_clamped_tokens": self.log_ratio_clamped,
        }


def micro_batch_loss(ctx: LearnerContext, mb: Batch, g_tokens: float, g_seqs: float):
    """The PPO loss of one micro-batch, normalised by the minibatch's global counts, and its local sums."""
    engine, config, temperature = ctx.engine, ctx.config, ctx.temperature
    with_entropy = config.entropy_coef > 0  # else the sampled tokens' -log pi estimates it, for free
    replay = config.router_replay != "none"  # R2 and R3 alike: the batch holds the routing
    scored = forward_scores(engine, mb, temperature, 0, config.pack_sequences, with_entropy, replay)
    logprobs, values = scored.logprobs, scored.values
    t, agg, horizon = mb.tokens, config.loss_agg, config.loss_norm_tokens
    reduce = functools.partial(
        aggregate_loss, agg=agg, global_tokens=g_tokens, global_seqs=g_seqs, horizon=horizon
    )
    pg, pg_m = policy_loss(
        logprobs,
        t.old_logprobs,
        t.advantages,
        mb.mask,
        clip_eps=config.clip.eps,
        clip_eps_high=config.clip.eps_high,
        dual_clip=config.clip.dual,
        is_weights=t.is_weights,
        agg=agg,
        global_tokens=g_tokens,
        global_seqs=g_seqs,
        loss=config.policy_loss,
        horizon=horizon,
    )
    if needs_critic(config.advantage):
        vclip = (
            None
            if config.value_clip == "off"
            else config.value_clip_eps
            if t.value_clip is None
            else t.value_clip
        )
        vf, vf_m = value_loss(values, t.old_values, t.returns, mb.mask, vclip, agg, g_tokens, g_seqs, horizon)
    else:  # no critic: no value loss (the value head is frozen, see LearnerRank.setup)
        vf, vf_m = torch.zeros((), device=logprobs.device), {"clip_frac": 0.0}
    ent = reduce(scored.entropy if with_entropy else -logprobs.detach(), mb.mask)
    loss = pg + config.vf_coef * vf - config.entropy_coef * ent
    if config.kl.mode == "loss":
        kl_term = kl_loss(logprobs, t.ref_logprobs, config.kl.loss_estimator)
        loss = loss + config.kl.loss_coef * reduce(kl_term, mb.mask)
    n = float(mb.mask.sum())
    local = UpdateSums(
        policy_loss=float(pg.detach()),
        value_loss=float(vf.detach()),
        entropy=float(ent.detach()),
        approx_kl=pg_m["approx_kl"] * n,
        policy_clip_frac=pg_m["clip_frac"] * n,
        value_clip_frac=vf_m["clip_frac"] * n,
        tokens=n,
        log_ratio_clamped=pg_m["log_ratio_clamped"],
    )
    return loss, scored, local


def ppo_update(ctx: LearnerContext, batch: Batch):
    """PPO epochs x minibatches x micro-batches on this rank; one optimizer step per minibatch on all ranks.

    Each minibatch is one slot of the LR schedule's clock, stepped or not (learner.lr_schedule)."""
    replays_routing(ctx.config, batch)  # refuses R3 without routing (bypass mode has no proximal pass)
    engine, config, temperature, pad_id, device = (
        ctx.engine,
        ctx.config,
        ctx.temperature,
        ctx.pad_id,
        ctx.device,
    )
    generator = ctx.generator
    world = world_size()
    n_local = len(batch)
    lr = float(engine.get_lr()[0])  # the policy's rate at this step's first optimizer step
    sums = UpdateSums()  # of the applied steps
    applied, skipped, empty, grad_norm = 0, 0, 0, 0.0
    zero_w = dummy_batch(pad_id).to(device)
    for _ in range(config.ppo_epochs):
        perm = torch.randperm(n_local, generator=generator)
        minibatches = list(torch.tensor_split(perm, config.num_minibatches))
        micro = [micro_batch_rows(batch, mb, config) for mb in minibatches]
        k = len(minibatches)
        n_micro = all_reduce([float(len(m)) for m in micro], "max", device).long().tolist()
        local_counts = [float(batch.mask[mb].sum()) for mb in minibatches] + [
            count_sequences(batch.mask[mb]) for mb in minibatches
        ]
        counts = all_reduce(local_counts, "sum", device).tolist()  # k token counts, then k sequence counts
        for j in range(k):
            if n_micro[j] == 0:  # no rank has data for this minibatch (fewer sequences than minibatches)
                advance_unapplied(engine)
                continue
            if counts[j] == 0:
                # no token left in the loss on any rank (every sample overlong-filtered): the loss is 0 and
                # a step on zero gradients would still move the weights (Adam's moments, weight decay)
                empty += 1
                advance_unapplied(engine)
                continue
            step_sums = UpdateSums()
            poisoned = False
            for i in range(n_micro[j]):
                engine.set_gradient_accumulation_boundary(i == n_micro[j] - 1)
                if i < len(micro[j]):
                    mb = batch.take(micro[j][i]).to(device)
                    loss, scored, local = micro_batch_loss(ctx, mb, counts[j], counts[k + j])
                    if torch.isfinite(loss):
                        engine.backward(loss * world, scale_wrt_gas=False)
                        step_sums.add(local)
                        continue
                    poisoned = True
                    scale = float("nan")
                else:
                    entropy = config.entropy_coef > 0  # the outputs a real micro-batch's loss reads
                    replay = config.router_replay != "none"  # R2 and R3 alike: the batch holds the routing
                    scored = forward_scores(
                        engine, zero_w, temperature, 0, config.pack_sequences, entropy, replay
                    )
                    scale = 0.0
                # a gradient (0, or NaN to force a skip) for every parameter a real micro-batch reaches
                anchored_backward(engine, scored, scale, needs_critic(config.advantage))
            engine.step()
            if engine.was_step_applied():
                if poisoned:
                    raise RuntimeError(
                        "DeepSpeed applied an optimizer step whose gradients were NaN on purpose"
                    )
                applied += 1
                sums.add(step_sums)
                grad_norm += float(engine.get_global_grad_norm() or 0.0)
            else:
                skipped += 1
                advance_unapplied(engine)  # DeepSpeed steps the schedule on applied steps only
    # no step taken: NaN, unless only because no minibatch had a token to train (a loss of 0, not a failure)
    no_step = 0.0 if empty and not skipped else float("nan")
    metrics = sums.all_reduced(device).metrics(applied, grad_norm, no_step)
    metrics.update(
        {"train/skipped_steps": float(skipped), "train/optimizer_steps": float(applied), "train/lr": lr}
    )
    return metrics


def train_step(
    ctx: LearnerContext, trajectories: Sequence[Trajectory], kl_controller, bypass: bool = False
) -> dict[str, float]:
    """One PPO iteration on this rank's shard; every returned metric is global (identical on all ranks).
    `bypass`: skip the proximal pass (`learner.bypass`, decided alike on every rank)."""
    start = time.perf_counter()
    config, device = ctx.config, ctx.device
    ctx.engine.train()
    batch = pack_trajectories(trajectories, ctx.pad_id)
    kl_coef = float(kl_controller.value)
    stats = prepare(ctx, batch, kl_coef, bypass)
    metrics = ppo_update(ctx, batch)
    if math.isfinite(stats["objective/kl"]) and stats["train/sequences"] > 0:
        kl_controller.update(stats["objective/kl"], int(stats["train/sequences"]))
    metrics = merge_metrics(metrics, stats)  # the update's and the batch's: no name is both
    metrics["objective/kl_coef"] = kl_coef if config.kl.mode == "reward" else config.kl.loss_coef
    metrics["train/compute_s"] = float(all_reduce([time.perf_counter() - start], "max", device)[0])
    return metrics
