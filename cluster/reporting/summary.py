"""What a run prints when it ends (or is interrupted), in the reward's own units."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunSummary:
    run_dir: str
    steps: int
    samples: int
    wall_s: float
    final_reward: float
    final_reward_prob: float | None
    final_kl: float
    policy_path: str | None
    metrics_path: str
    checkpoint: str | None = None
    interrupted: bool = False
    extra: list[str] = field(default_factory=list)  # more result lines (held-out before -> after)

    def scalars(self) -> dict[str, float]:
        """The summary's numbers, for the run's loggers (`cluster.reporting.trackers.base.RUN`)."""
        out = {
            "steps": float(self.steps),
            "samples": float(self.samples),
            "wall_s": self.wall_s,
            "final_reward": self.final_reward,
            "final_kl": self.final_kl,
            "interrupted": float(self.interrupted),
        }
        if self.final_reward_prob is not None:
            out["final_reward_prob"] = self.final_reward_prob
        return out

    def lines(self) -> list[str]:
        prob = f" (P(positive) {self.final_reward_prob:.3f})" if self.final_reward_prob is not None else ""
        head = "interrupted after" if self.interrupted else "finished"
        out = [
            f"{head} {self.steps} steps, {self.samples} samples, wall {self.wall_s:.1f}s",
            f"final reward {self.final_reward:.3f}{prob}, KL to reference {self.final_kl:.3f}",
            *self.extra,
            f"run folder   {self.run_dir}",
            f"metrics      {self.metrics_path}",
        ]
        if self.policy_path:
            out.append(f"final policy {self.policy_path}")
        if self.checkpoint:
            out.append(f"checkpoint   {self.checkpoint}  (continue with --resume {self.run_dir})")
        return out
