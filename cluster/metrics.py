"""Per-step metrics: what a trained step reports (`StepMetrics`), written to JSONL (always) and
TensorBoard (when installed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .chunks import Parts, RolloutBatch, kept
from .summary import reward_to_prob


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                self._tb = None

    @property
    def tensorboard_dir(self) -> str | None:
        return self._tb.log_dir if self._tb is not None else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (float(v) if v is not None else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if v is not None and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def truncate_metrics(path: str | Path, last_step: int) -> list[dict[str, float]]:
    """Keep only rows up to `last_step` (a resumed run rewrites what came after its checkpoint)."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = [r for r in read_metrics(path) if r["step"] <= last_step]
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
    return rows


class StepMetrics:
    """The metrics of a trained step, the same in both pipelines (a mixin of
    `cluster.controller.Trainer`, which provides cfg, data_stats, version and roles)."""

    def sample_metrics(self, parts: Parts, wall: float) -> dict[str, float]:
        """The metrics of a step's samples (`parts`, as the learner took them) and of the data, the
        same in both modes: from the chunks' facts and scores, never the samples themselves."""
        trained = kept(parts)
        scores = np.array([float(c.scores.scores[j]) for c, j in trained])
        lengths = np.array([c.facts[j][2] for c, j in trained])
        finish = [c.facts[j][3] for c, j in trained]
        failures = sum(len(pos) for _c, pos in parts) - len(trained)
        stats = self.data_stats
        m = {
            "rollout/reward_mean": float(scores.mean()),
            "rollout/reward_std": float(scores.std()),
            "rollout/response_length": float(lengths.mean()),
            "rollout/truncated_frac": float(np.mean([f == "length" for f in finish])),
            "rollout/samples": float(len(scores)),
            "rollout/reward_failures": float(failures),
            "throughput/tokens_per_s": float(lengths.sum()) / wall,
            "throughput/samples_per_s": len(scores) / wall,
            "data/empty_prompts": float(stats.empty),
            "data/truncated_prompts": float(stats.truncated),
            "data/skipped_prompts": float(stats.skipped_long),
        }
        probs = reward_to_prob(scores, self.cfg.reward.kind, self.cfg.reward.score)
        if probs is not None:
            m["rollout/reward_prob_mean"] = float(probs.mean())
        return m

    def step_metrics(
        self, batch: RolloutBatch, learner: dict, t_train: float, t_sync: float, wall: float
    ) -> dict:
        staleness = [self.version - 1 - c.facts[j][1] for c, j in batch.kept]
        return {
            **self.sample_metrics(batch.parts, wall),
            "rollout/queue_depth": float(batch.queue_depth),
            "rollout/staleness_mean": float(np.mean(staleness)),
            **learner,
            "time/generate": batch.time_generate,
            "time/score": batch.time_score,
            "time/train": t_train,
            "time/weight_sync": t_sync,
            "time/step": wall,
            "policy_version": float(self.version),
            "scale/rollout_workers": float(len(self.roles.workers)),
            "faults/actor_replacements": float(batch.replacements + self.sync_replacements),
            "faults/redispatched_chunks": float(batch.redispatched),
            "faults/lost_chunks": float(batch.lost),
        }
