"""Dynamic sampling (`data.dynamic_sampling`): groups whose rewards carry no signal are dropped before
the learner sees them, and the step's batch is refilled with more prompts (DAPO's dynamic sampling,
OpenRLHF's dynamic filtering, slime's check_reward_nonzero_std).

Pure Python, no Ray, in the style of `cluster.pipeline.stream_buffer`: the filter rules, the split of a scored
chunk into kept and filtered groups, and the per-step accounting. Both pipelines use it:
- sync (`SyncPipeline.step`): rounds of collect -> filter -> draw exactly the missing number of prompts,
  until the batch holds `data.prompts_per_step` informative groups or `max_rounds` rounds ran;
- async (`StreamBuffer.add_scored`): a scored chunk's filtered groups never enter the buffer and give
  their admission slot back (a new prompt takes it).

A group is the samples of one prompt in one chunk. The filter sees the rewards of the group's samples
whose reward succeeded (a failed reward is dropped and counted, never scored); a group with no
successful reward is filtered without calling the filter. A sample's reward is its return
(`ScoreBatch.returns`: a multi-turn episode's outcome plus its earlier turns' rewards, when they are
trained), the number grpo and rloo train on, so a group of equal outcomes but different returns is
kept. Every drawn prompt ends exactly once as trained or filtered (or, in async mode, still
outstanding: re-generated after a resume).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.config.filters import FILTERS, check_filter_spec
from reward_service.rules import import_user_module

GroupFilter = Callable[[np.ndarray], bool]  # rewards of one group -> keep it?


class DynamicSamplingError(RuntimeError):
    """No informative group could be found within data.dynamic_sampling.max_rounds."""


def no_filter(std_eps: float) -> None:
    """'none': no filter, every group is trained (dynamic sampling off)."""
    return None


def nonzero_std(std_eps: float) -> GroupFilter:
    """Keep a group whose rewards' (population) standard deviation exceeds `std_eps`."""

    def keep(rewards: np.ndarray) -> bool:
        return len(rewards) > 1 and float(np.std(rewards)) > std_eps

    keep.__name__ = "nonzero_std"
    return keep


def _load_user_function(spec: str) -> Callable[..., Any]:
    module_name, _, func_name = spec.rpartition(":")
    module = import_user_module(module_name, "data.dynamic_sampling.filter")
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"data.dynamic_sampling.filter: {module_name!r} has no function {func_name!r}")
    return fn


def resolve_filter(spec: str, std_eps: float = 1e-6) -> GroupFilter | None:
    """The filter named by `spec` (None for 'none': dynamic sampling off). A user function gets the
    group's rewards as a float64 array and returns whether to keep the group (truthy)."""
    check_filter_spec(spec)
    if spec in FILTERS:
        return FILTERS.function(spec)(std_eps)
    fn = _load_user_function(spec)

    def keep(rewards: np.ndarray) -> bool:
        return bool(fn(np.asarray(rewards, dtype=np.float64)))

    keep.__name__ = spec
    return keep


# ---------------------------------------------------------------------- groups of a scored chunk


def groups(chunk: Any) -> list[list[int]]:
    """Per prompt of `chunk` (in `chunk.prompts` order), the positions of its samples (facts order). A
    prompt drawn twice into one chunk (a shuffled epoch's end and the next one's start) is two groups:
    its samples, in prompt order, are split evenly between its occurrences."""
    by_index: dict[int, list[int]] = collections.defaultdict(list)
    for j, fact in enumerate(chunk.facts):
        by_index[fact[0]].append(j)
    copies = collections.Counter(p.index for p in chunk.prompts)
    taken: collections.Counter[int] = collections.Counter()
    out = []
    for p in chunk.prompts:
        share = np.array_split(np.asarray(by_index.get(p.index, []), dtype=np.int64), copies[p.index])
        out.append([int(j) for j in share[taken[p.index]]])
        taken[p.index] += 1
    return out


def group_rewards(chunk: Any, positions: Sequence[int]) -> np.ndarray:
    """The successful rewards (returns, `ScoreBatch.returns`) of the samples at `positions` of `chunk`."""
    s = chunk.scores
    return np.array([float(s.returns[j]) for j in positions if s.ok[j]], dtype=np.float64)


def keeps(keep: GroupFilter | None, rewards: np.ndarray) -> bool:
    """Whether a group with these (successful) rewards is trained: always without a filter; never
    when no reward succeeded; else the filter's answer."""
    if keep is None:
        return True
    return len(rewards) > 0 and bool(keep(rewards))


def split_chunk(chunk: Any, keep: GroupFilter | None) -> tuple[dict[int, list[int]], list[int]]:
    """(kept: position of the prompt in `chunk.prompts` -> its samples' positions, filtered: prompt
    indices) of a scored chunk, in prompt order (`groups`: a prompt drawn twice is two groups). A
    prompt with no sample at all (none generated) counts as kept with no positions, as the buffer has
    always held it."""
    by_prompt = groups(chunk)
    if keep is None:  # no filter: the scores are not read
        return dict(enumerate(by_prompt)), []
    kept: dict[int, list[int]] = {}
    filtered: list[int] = []
    for i, (p, positions) in enumerate(zip(chunk.prompts, by_prompt, strict=True)):
        if not positions or keeps(keep, group_rewards(chunk, positions)):
            kept[i] = positions
        else:
            filtered.append(p.index)
    return kept, filtered


# ---------------------------------------------------------------------- per-step accounting


def round_seed(run_seed: int, round_index: int) -> int:
    """The run seed the sync collector draws round `round_index`'s chunk seeds from: round 0 keeps the
    run's seed (a step that needs no refill samples exactly as without dynamic sampling), a refill
    round gets its own stream of seeds."""
    if round_index == 0:
        return run_seed
    return int(np.random.SeedSequence([run_seed, 0xD5, round_index]).generate_state(1)[0])


@dataclass
class StepAccount:
    """What dynamic sampling did in one learner step: prompts drawn (first batch + refills), groups kept
    and filtered, rounds (sync: collect calls; async: batches' worth of groups seen)."""

    target: int  # data.prompts_per_step
    drawn: int = 0
    kept: int = 0
    filtered: int = 0
    rounds: int = 0
    filtered_prompts: list[int] = field(default_factory=list)

    @property
    def missing(self) -> int:
        return max(0, self.target - self.kept)

    def record_round(self, drawn: int, kept: int, filtered: list[int]) -> None:
        if kept + len(filtered) != drawn:
            raise ValueError(f"a round drew {drawn} prompts but kept {kept} and filtered {len(filtered)}")
        self.drawn += drawn
        self.kept += kept
        self.filtered += len(filtered)
        self.filtered_prompts += list(filtered)
        self.rounds += 1

    def finished(self, max_rounds: int) -> bool:
        """Sync: stop collecting (the batch is full, or `max_rounds` rounds ran)."""
        return self.missing == 0 or self.rounds >= max_rounds

    def next_draw(self) -> int:
        """Sync: prompts to draw for the next round: exactly the missing groups, so a round never
        produces a surplus (every drawn prompt is trained this step or filtered)."""
        return self.missing

    @property
    def extra_prompts(self) -> int:
        """Prompts drawn beyond the step's batch (the refills)."""
        return max(0, self.drawn - self.target)

    def check_trainable(self, max_rounds: int) -> None:
        if self.kept == 0:
            raise DynamicSamplingError(
                f"dynamic sampling found no informative group in {self.rounds} rounds ({self.filtered} groups "
                f"filtered, data.dynamic_sampling.max_rounds={max_rounds}): every group's rewards were equal. "
                "Raise data.dynamic_sampling.max_rounds, check the reward, or set data.dynamic_sampling.filter='none'"
            )

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic/filtered_groups": float(self.filtered),
            "dynamic/extra_prompts": float(self.extra_prompts),
            "dynamic/rounds": float(self.rounds),
            "dynamic/shortfall_groups": float(self.missing),
        }


def async_rounds(trained: int, filtered: int, target: int) -> int:
    """Async: batches' worth of groups the step saw (trained + filtered since the previous batch)."""
    return max(1, math.ceil((trained + filtered) / target))
