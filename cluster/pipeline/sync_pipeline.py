"""The lock-step pipeline (`pipeline.mode: sync`): prompts -> rollout -> scoring -> learner -> weight
push, one phase after the other. Every rollout worker holds the newest weights when a step starts;
scaling resizes the pools between steps."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from cluster.pipeline.collector import RolloutCollector
from cluster.pipeline.dynamic_sampling import StepAccount, round_seed, split_chunk
from cluster.pipeline.failures import check_failures
from cluster.pipeline.pipelines import RunParts, StepResult, replace_in_pool
from cluster.records.chunks import RolloutBatch
from cluster.reporting.metrics import StepFaults, StepTimes, step_metrics
from cluster.weights.publisher import WeightPublisher
from kernel.metric_names import merge_metrics


class SyncPipeline:
    """One step: collect a batch (with dynamic sampling, round after round), train every rank on it,
    push the new weights to every worker, evaluate when due. See `cluster.pipeline.pipelines`."""

    publisher: ClassVar[type[WeightPublisher]] = WeightPublisher

    def __init__(self, parts: RunParts, resume: dict | None) -> None:
        self.parts = parts
        self.collector = parts.collector(RolloutCollector)

    def state(self) -> dict:
        return {}

    def replace_lost_worker(self, member: Any) -> None:
        replace_in_pool(self.parts.roles, member)

    def workers_to_current(self) -> None:
        """Nothing to do: every step ends with a push to every worker."""

    def scale(self, targets: dict[str, int]) -> list[str]:
        events = []
        pools = self.parts.roles.by_role
        for role, want in targets.items():
            if role not in pools:  # a group beside the plan (below)
                continue
            added, removed = pools[role].resize(int(want))
            events += [f"+{n}" for n in added] + [f"-{n}" for n in removed]
        return events + self.parts.roles.scale_groups(targets)

    def step(self, step: int, targets: dict[str, int]) -> StepResult:
        p = self.parts
        cfg, progress = p.cfg, p.progress
        t0 = time.perf_counter()
        scaling = self.scale(targets)
        account = None
        if p.group_filter is None:
            prompts = p.stream.next_batch(cfg.data.prompts_per_step)
            batch = self.collector.collect(prompts, step, cfg.run.seed, cfg.rollout.chunk_size)
            check_failures(cfg, step, batch.parts, batch.total, p.failures)
        else:
            batch, account = self.collect_informative(step)
        t1 = time.perf_counter()
        learner_metrics = p.learner.learn(batch, step, self.collector.regather, p.weights.version)
        t_train = time.perf_counter() - t1
        t_sync = p.weights.push(step)
        progress.step = step
        progress.samples_seen += len(batch.kept)
        progress.record_batch(batch.parts)
        version = p.weights.version
        wall = time.perf_counter() - t0
        metrics = step_metrics(
            batch.parts,
            learner_metrics,
            StepTimes(batch.time_generate, batch.time_score, t_train, t_sync, wall),
            StepFaults(batch.replacements + p.weights.replacements, batch.redispatched, batch.lost),
            [version - 1 - c.facts[j].version for c, j in batch.kept],
            data_stats=p.data_stats,
            reward=cfg.reward,
            version=version,
            workers=len(p.roles.workers),
            own={"rollout/queue_depth": float(batch.queue_depth), "scale/events": float(len(scaling))},
        )
        if account is not None:
            progress.record_filtered(account.filtered_prompts)
            dynamic = {**account.metrics(), "dynamic/filtered_total": float(progress.filtered_total)}
            metrics = merge_metrics(metrics, dynamic)
        if p.evaluator.due(step):
            metrics = merge_metrics(metrics, p.evaluator.evaluate(f"held-out evaluation at step {step}")[0])
        return StepResult(metrics)

    def collect_informative(self, step: int) -> tuple[RolloutBatch, StepAccount]:
        """Dynamic sampling, sync: collect, drop the groups the filter refuses, draw exactly the missing
        number of prompts and collect again (round r's chunk seeds come from `round_seed`), until the
        batch holds data.prompts_per_step groups or max_rounds rounds ran. Every drawn prompt is either
        in the returned batch or in the account's filtered prompts; none is carried to the next step."""
        cfg = self.parts.cfg
        ds = cfg.data.dynamic_sampling
        account = StepAccount(cfg.data.prompts_per_step)
        merged = RolloutBatch(selected={})
        want = account.target
        while True:
            prompts = self.parts.stream.next_batch(want)
            seed = round_seed(cfg.run.seed, account.rounds)
            got = self.collector.collect(prompts, step, seed, cfg.rollout.chunk_size)
            check_failures(cfg, step, got.parts, got.total, self.parts.failures)
            kept_groups, filtered = 0, []
            for chunk in got.chunks:
                kept_pos, dropped = split_chunk(chunk, self.parts.group_filter)
                filtered += dropped
                if not kept_pos:
                    continue
                kept_groups += len(kept_pos)
                chunk.index = len(merged.chunks)  # unique within the merged batch (regather finds it)
                merged.chunks.append(chunk)
                merged.selected[chunk.index] = sorted(j for pos in kept_pos.values() for j in pos)
            account.record_round(len(prompts), kept_groups, filtered)
            merged.count_in(got)
            if account.finished(ds.max_rounds):
                break
            want = account.next_draw()
        account.check_trainable(ds.max_rounds)
        return merged, account
