"""Group-baseline estimators (grpo, rloo: `learner.registry.ADVANTAGES[...].groups`) give a sample its
reward minus its group's baseline: a group whose rewards are all equal trains nothing. When every group of
`STEPS` consecutive steps was flat (rollout/flat_groups_frac = 1), the policy has had no gradient for that
long, most often because the reward depends on the prompt only: one warning says so, once per run."""

from __future__ import annotations

import collections
import sys

import numpy as np

from cluster.records.chunks import Parts, kept
from learner.registry import ADVANTAGES

STEPS = 3  # consecutive steps of only flat groups before the warning
METRIC = "rollout/flat_groups_frac"


def flat_groups_frac(parts: Parts) -> float | None:
    """The share of the groups of `parts` (a prompt's trained samples in one chunk) of two samples or more
    whose rewards (`ScoreBatch.returns`) are all equal; None when no group has two samples."""
    groups = collections.defaultdict(list)
    for c, j in kept(parts):
        groups[c.index, c.facts[j].prompt_index].append(float(c.scores.returns[j]))
    sizable = [g for g in groups.values() if len(g) >= 2]
    return float(np.mean([np.ptp(g) == 0 for g in sizable])) if sizable else None


class FlatGroupWatch:
    """Counts consecutive steps whose groups were all flat, for `advantage` (the config's
    learner.advantage); warns once, on stderr, at the `STEPS`-th."""

    def __init__(self, advantage: str, steps: int = STEPS) -> None:
        self.advantage, self.steps = advantage, steps
        self.active = ADVANTAGES[advantage].groups
        self.run, self.warned = 0, False

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics row (its `METRIC`, when it has one)."""
        if not self.active or self.warned:
            return
        self.run = self.run + 1 if metrics.get(METRIC) == 1.0 else 0
        if self.run < self.steps:
            return
        self.warned = True
        print(
            f"warning: every group's rewards were equal for {self.steps} consecutive steps (steps "
            f"{step - self.steps + 1}-{step}, {METRIC} = 1): with learner.advantage={self.advantage!r} each "
            "sample's advantage is its reward minus its group's baseline, 0 here, so the policy gets no "
            "gradient. A reward that depends on the prompt only (not the response) does this, as does a task "
            "every sample solves or every sample fails: check the reward, or set "
            "data.dynamic_sampling.filter='nonzero_std' to train on the groups with a spread only.",
            file=sys.stderr,
            flush=True,
        )
