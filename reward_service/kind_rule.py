"""reward.kind='rule': reward functions (reward.rule or reward.functions); a sample's score is their
weighted sum (`reward_service.weighted`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from reward_service.config import RewardConfig
from reward_service.samples import Samples, ScoreBatch
from reward_service.weighted import load_functions, score_functions


class RuleBackend:
    def __init__(self, config: RewardConfig, model: Any = None) -> None:
        if not config.function_entries():
            raise ValueError(
                "reward.kind='rule' needs reward.rule (a registered rule name) or reward.functions"
            )
        self.config = config
        self.functions = load_functions(config)

    def score(self, samples: Samples, out: ScoreBatch) -> None:
        """The weighted sum of the reward functions as each sample's score, each function's values and
        where it failed; a function that hangs past reward.function_timeout_s raises, naming its inputs'
        prompt rows."""
        index = samples.live
        inputs = samples.inputs()

        def name(k: int) -> str:  # input k as a hang's message names it (asked only then)
            return samples.name(index[k], inputs[k].prompt)

        timeout = self.config.function_timeout_s
        scored = score_functions(self.functions, inputs, self.config.batch_size, timeout, name)
        for k, i in enumerate(index):
            if scored.errors[k] is not None:
                out.fail(i, scored.errors[k])
            else:
                out.set(i, scored.total[k], "the reward functions' weighted sum")
        for fn, values in scored.values.items():
            column = np.full(len(out.ok), np.nan, dtype=np.float32)
            column[index] = values
            out.function_values[fn] = column
            failed = np.zeros(len(out.ok), dtype=bool)
            failed[index] = scored.failed[fn]
            out.function_failures[fn] = failed
