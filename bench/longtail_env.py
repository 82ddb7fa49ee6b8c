"""The long-tail workload of `make bench-async`: each episode runs k model turns, k drawn from its prompt
with P(k) proportional to 1/k^2 on 1..`longest` (median 1 turn, the longest `longest` times it), the
environment answering each turn with ' and' so the review goes on. Scored by the run's reward model
on the whole response; the environment gives no reward. Shipped to the workers as a file
(`rollout.environment.module: bench/longtail_env.py`)."""

from __future__ import annotations

import random
import zlib

from rollout_workers.environment import Environment, Step, register_environment


@register_environment("longtail")
class LongTail(Environment):
    def __init__(self, longest: int = 8, observation: str = " and") -> None:
        self.longest, self.observation = longest, observation
        self.weights = [1.0 / k**2 for k in range(1, longest + 1)]

    def reset(self, prompt, meta):
        rng = random.Random(zlib.crc32(prompt.encode()))
        return {"left": rng.choices(range(1, self.longest + 1), weights=self.weights)[0]}

    def step(self, model_turn, state):
        state["left"] -= 1
        if state["left"] <= 0:
            return Step("", None, True)
        return Step(self.observation, None, False)
