"""Environments for the multi-turn pipeline tests, named by file (`rollout.environment.module:
tests/multiturn_envs.py`): the run ships the file to its rollout workers."""

from __future__ import annotations

import time
import zlib

from rollout_workers.environment import Environment, Step, register_environment


@register_environment("test-review")
class ReviewEnvironment(Environment):
    """Answers each turn with ' so', then after `turns` turns scores the episode: 1 when the last turn
        has more than `long` tokens' worth of words, else 0 (a reward the policy can move). A prompt whose
        crc32 is divisible by `fail_every` raises in its first step, one whose crc32 is 1 modulo `hang_every`
    never answers it (0: never). Each step takes `delay` seconds (a slow tool)."""

    def __init__(
        self, turns: int = 2, long: int = 6, fail_every: int = 0, hang_every: int = 0, delay: float = 0.0
    ) -> None:
        self.turns, self.long, self.fail_every, self.hang_every = turns, long, fail_every, hang_every
        self.delay = delay

    def reset(self, prompt, meta):
        crc = zlib.crc32(prompt.encode())
        fails = self.fail_every > 0 and crc % self.fail_every == 0
        hangs = self.hang_every > 0 and crc % self.hang_every == 1
        return {"turn": 0, "fails": fails, "hangs": hangs}

    def step(self, model_turn, state):
        state["turn"] += 1
        time.sleep(self.delay)
        if state["fails"]:
            raise RuntimeError("this prompt's sandbox always crashes")
        if state["hangs"]:
            time.sleep(3600)  # a sandbox that never answers
        if state["turn"] < self.turns:
            return Step(" so", None, False, {"tool_calls": 1.0})
        return Step("", 1.0 if len(model_turn.split()) > self.long else 0.0, True)
