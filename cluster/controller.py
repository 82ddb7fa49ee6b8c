"""The synchronous PPO loop: prompts -> rollout -> scoring -> learner -> weight push.

The controller owns no model; it moves records between roles, times every phase, and keeps the
only state needed to resume besides the learner's own (data position, step, policy version).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import yaml
from transformers import AutoTokenizer

from .actors import Roles, start_roles, stop_roles
from .config import RunConfig
from .data import DataStats, Prompt, PromptStream, read_prompts, tokenize_prompts
from .metrics import MetricsWriter
from .rollout import RolloutBatch, chunk_seed, collect_rollout
from .weight_sync import push_weights


class LearnerStepError(RuntimeError):
    """The learner failed or timed out; the run stops (its last checkpoint stays resumable)."""


@dataclass
class RunSummary:
    run_dir: str
    steps: int
    samples: int
    wall_s: float
    final_reward: float
    final_reward_prob: float | None
    final_kl: float
    policy_path: str
    metrics_path: str

    def lines(self) -> list[str]:
        prob = f" (P(positive) {self.final_reward_prob:.3f})" if self.final_reward_prob is not None else ""
        return [
            f"steps {self.steps}, samples {self.samples}, wall {self.wall_s:.1f}s",
            f"final reward {self.final_reward:.3f}{prob}, KL to reference {self.final_kl:.3f}",
            f"run folder   {self.run_dir}",
            f"metrics      {self.metrics_path}",
            f"final policy {self.policy_path}",
        ]


def reward_to_prob(scores: np.ndarray, kind: str, score: str) -> np.ndarray | None:
    """P(positive) for classifier rewards, so the demo reads in the classifier's own units."""
    if kind != "model":
        return None
    if score == "logit_diff":
        return 1.0 / (1.0 + np.exp(-scores))
    if score == "prob":
        return scores
    return None


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.version = 0
        self.step = 0
        self.samples_seen = 0
        self.roles: Roles | None = None
        self.writer: MetricsWriter | None = None
        self.history: list[dict[str, float]] = []

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        )
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        prompts, self.data_stats = tokenize_prompts(read_prompts(cfg.data), self.tokenizer, cfg.data)
        self.prompts: list[Prompt] = prompts
        self.stream = PromptStream(prompts, cfg.run.seed, cfg.data.shuffle)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.roles = start_roles(cfg, pad)
        self.writer = MetricsWriter(self.run_dir, cfg.run.tensorboard)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.roles is not None:
            stop_roles(self.roles)
            self.roles = None

    # ------------------------------------------------------------------ one iteration

    def rollout(self, prompts: list[Prompt], step: int) -> RolloutBatch:
        cfg, roles = self.cfg, self.roles
        return collect_rollout(
            prompts,
            step,
            cfg.run.seed,
            cfg.rollout.chunk_size,
            roles.workers,
            roles.worker_names,
            roles.references,
            roles.scorers,
            cfg.timeouts.generate_s,
            cfg.timeouts.score_s,
        )

    def learn(self, batch: RolloutBatch) -> dict[str, float]:
        ranks = self.roles.ranks
        shards = [list(s) for s in np.array_split(np.asarray(batch.trajectories, dtype=object), len(ranks))]
        refs = [r.train_step.remote(shard) for r, shard in zip(ranks, shards, strict=True)]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeouts.train_s)
        if pending:
            raise LearnerStepError(
                f"learner step not done within {self.cfg.timeouts.train_s:.0f}s (timeouts.train_s)"
            )
        try:
            return ray.get(refs)[0]
        except ray.exceptions.RayError as err:
            raise LearnerStepError(f"learner step failed: {err}") from err

    def iteration(self) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        step = self.step + 1
        prompts = self.stream.next_batch(cfg.data.prompts_per_step)
        batch = self.rollout(prompts, step)
        if not batch.trajectories:
            raise RuntimeError(f"step {step}: every sample's reward failed, e.g. {batch.reward_errors[:1]}")
        if step == 1:
            self.print_samples("before training (step 1 samples)", batch)
        t1 = time.perf_counter()
        learner_metrics = self.learn(batch)
        t_train = time.perf_counter() - t1
        sync, _ = push_weights(
            self.roles.ranks,
            self.roles.workers,
            self.roles.worker_names,
            step,
            cfg.rollout.dtype,
            cfg.timeouts.weight_sync_s,
        )
        self.version = sync.version
        self.step = step
        self.samples_seen += len(batch.samples)
        wall = time.perf_counter() - t0
        lengths = np.array([len(s.response_ids) for s in batch.samples])
        metrics = {
            "rollout/reward_mean": float(batch.scores.mean()),
            "rollout/reward_std": float(batch.scores.std()),
            "rollout/response_length": float(lengths.mean()),
            "rollout/truncated_frac": float(np.mean([s.finish_reason == "length" for s in batch.samples])),
            "rollout/samples": float(len(batch.samples)),
            "rollout/reward_failures": float(batch.dropped),
            **learner_metrics,
            "time/generate": batch.time_generate,
            "time/score": batch.time_score,
            "time/train": t_train,
            "time/weight_sync": sync.seconds,
            "time/step": wall,
            "throughput/tokens_per_s": float(lengths.sum()) / wall,
            "throughput/samples_per_s": len(batch.samples) / wall,
            "policy_version": float(self.version),
        }
        probs = reward_to_prob(batch.scores, cfg.reward.kind, cfg.reward.score)
        if probs is not None:
            metrics["rollout/reward_prob_mean"] = float(probs.mean())
        self.writer.write(step, metrics)
        self.history.append(metrics)
        return metrics

    # ------------------------------------------------------------------ whole run

    def train(self) -> RunSummary:
        t0 = time.perf_counter()
        bar = None
        if self.cfg.run.progress_bar:
            from tqdm import tqdm

            bar = tqdm(
                total=self.cfg.run.steps, initial=self.step, desc="ppo", unit="step", dynamic_ncols=True
            )
        while self.step < self.cfg.run.steps:
            m = self.iteration()
            if bar is not None:
                post = {
                    "reward": f"{m['rollout/reward_mean']:.3f}",
                    "kl": f"{m.get('objective/kl', math.nan):.3f}",
                }
                if "rollout/reward_prob_mean" in m:
                    post["p_pos"] = f"{m['rollout/reward_prob_mean']:.3f}"
                bar.set_postfix(post)
                bar.update(1)
        if bar is not None:
            bar.close()
        final_dir = self.run_dir / "final"
        ray.get(
            [r.save_pretrained.remote(str(final_dir)) for r in self.roles.ranks],
            timeout=self.cfg.timeouts.train_s,
        )
        self.tokenizer.save_pretrained(str(final_dir))
        self.print_samples("after training", self.evaluate())
        tail = self.history[-5:]
        prob = [m["rollout/reward_prob_mean"] for m in tail if "rollout/reward_prob_mean" in m]
        return RunSummary(
            run_dir=str(self.run_dir),
            steps=self.step,
            samples=self.samples_seen,
            wall_s=time.perf_counter() - t0,
            final_reward=float(np.mean([m["rollout/reward_mean"] for m in tail])),
            final_reward_prob=float(np.mean(prob)) if prob else None,
            final_kl=float(np.mean([m.get("objective/kl", math.nan) for m in tail])),
            policy_path=str(final_dir),
            metrics_path=str(self.writer.path),
        )

    def evaluate(self) -> RolloutBatch:
        """Sample the fixed first prompts with the current weights (for the 'after' printout)."""
        k = max(self.cfg.run.sample_log_count, 1)
        return self.rollout(self.prompts[:k], step=10**9)

    def print_samples(self, title: str, batch: RolloutBatch) -> None:
        k = self.cfg.run.sample_log_count
        if k == 0:
            return
        probs = reward_to_prob(batch.scores, self.cfg.reward.kind, self.cfg.reward.score)
        print(f"\n--- {title} ---", flush=True)
        for i, s in enumerate(batch.samples[:k]):
            prompt = self.tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
            response = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
            extra = f", P(pos) {probs[i]:.3f}" if probs is not None else ""
            print(f"[reward {batch.scores[i]:+.2f}{extra}] {prompt} || {response}", flush=True)


__all__ = ["Trainer", "RunSummary", "DataStats", "chunk_seed"]
