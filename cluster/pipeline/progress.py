"""What a run has done so far, and its checkpoints: the trainer's resumable state besides the learner's.

`RunProgress` is the bookkeeping both pipelines share (steps, samples, which prompts were trained or
filtered; the metric rows written); `Checkpointer` writes it with the learner's DeepSpeed state when
the cadence says so and reads it back on resume. The published weight version is the publisher's
(`cluster.weights.publisher`); the prompt stream's position and the async buffer's state come as `extra`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from cluster.config.schema import RunConfig
from cluster.pipeline.checkpoint import LEARNER_DIR, Cadence, checkpoint_step, read_state, save_checkpoint
from cluster.records.chunks import Parts, kept


@dataclass
class RunProgress:
    step: int = 0
    samples_seen: int = 0
    trained_prompts: collections.Counter[int] = field(default_factory=collections.Counter)
    # dynamic sampling: prompts whose groups were filtered (never trained), and how many in all
    filtered_prompts: collections.Counter[int] = field(default_factory=collections.Counter)
    filtered_total: int = 0
    # prompts of a trained batch none of whose samples could be trained: every reward or environment failed
    skipped_prompts: collections.Counter[int] = field(default_factory=collections.Counter)
    history: list[dict[str, float]] = field(default_factory=list)  # the metric rows of steps 1..step

    def record_batch(self, parts: Parts) -> None:
        """A trained batch's prompts: trained (one sample kept at least) or skipped (all failed). One count
        per prompt and chunk, so a prompt handed out twice would show twice."""
        trained = {(c.index, c.facts[j].prompt_index) for c, j in kept(parts)}
        drawn = {(c.index, c.facts[j].prompt_index) for c, pos in parts for j in pos}
        self.trained_prompts.update(p for _c, p in trained)
        self.skipped_prompts.update(p for _c, p in drawn - trained)

    def record_filtered(self, indices: list[int]) -> None:
        """Dynamic sampling: prompts whose groups were filtered (drawn and used up, never trained)."""
        self.filtered_prompts.update(indices)
        self.filtered_total += len(indices)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "trained_prompts": {str(k): v for k, v in self.trained_prompts.items()},
            "filtered_prompts": {str(k): v for k, v in self.filtered_prompts.items()},
            "filtered_total": self.filtered_total,
            "skipped_prompts": {str(k): v for k, v in self.skipped_prompts.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.trained_prompts = collections.Counter({int(k): v for k, v in state["trained_prompts"].items()})
        self.filtered_prompts = collections.Counter(
            {int(k): v for k, v in state.get("filtered_prompts", {}).items()}
        )
        self.filtered_total = int(state.get("filtered_total", 0))
        self.skipped_prompts = collections.Counter(
            {int(k): v for k, v in state.get("skipped_prompts", {}).items()}
        )


class Checkpointer:
    """The run's checkpoints: when one is due (`checkpoint.every_steps` / `every_minutes`), writing one
    per step at most, pruning (`keep_last`, `keep_best` by `best_metric`) and reading one back."""

    def __init__(self, run_dir: Path, cfg: RunConfig) -> None:
        self.run_dir, self.cfg = run_dir, cfg
        ck = cfg.checkpoint
        self.cadence = Cadence(ck.every_steps, ck.every_minutes)
        self.last: Path | None = None

    def due(self, step: int) -> bool:
        return self.cadence.due(step)

    def save(self, ranks: list[Any], progress: RunProgress, version: int, extra: dict) -> Path:
        """Write the checkpoint of `progress.step` (once: a second call at the same step returns it)."""
        if self.last is not None and checkpoint_step(self.last) == progress.step:
            return self.last
        ck = self.cfg.checkpoint
        score = progress.history[-1].get(ck.best_metric) if progress.history else None
        state = {**progress.state_dict(), "version": version, "score": score, **extra}
        keep = (ck.keep_last, ck.keep_best, ck.best_mode)
        self.last = save_checkpoint(
            self.run_dir, progress.step, ranks, state, keep, self.cfg.timeouts.train_s
        )
        self.cadence.written()
        return self.last

    def restore(self, ckpt: Path, ranks: list[Any]) -> dict:
        """Every learner rank loads `ckpt`'s state; returns the run state saved with it."""
        state = read_state(ckpt)
        refs = [r.load_checkpoint.remote(str(ckpt / LEARNER_DIR)) for r in ranks]
        ray.get(refs, timeout=self.cfg.timeouts.train_s)
        self.last = ckpt
        return state

    def resume_hint(self) -> str:
        """The message tail of an error that stops the run: how to continue it."""
        return f"; resume with --resume {self.run_dir}" if self.last else ""
