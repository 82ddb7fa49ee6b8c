"""The learner ranks as the driver sees them: start a step on a batch's parts, take each rank's answer
(a rank that fails, dies or runs past `timeouts.train_s` stops the run with a resumable message), and
in sync mode retry a step whose inputs were lost with their node."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from cluster.config.schema import RunConfig
from cluster.placement.launch import Roles
from cluster.records.chunks import Parts, RolloutBatch
from cluster.records.groups import LostInputs, shard_parts
from cluster.records.ray_waits import DEAD_ACTOR_ERRORS, wait_until
from cluster.roles.registry import LEARNER


class LearnerStepError(RuntimeError):
    """The learner failed or timed out; the run stops (its last checkpoint stays resumable)."""


def engines_hold(cfg: RunConfig, version: int) -> int | None:
    """The version the driver vouches every rollout engine holds as the learner's current weights, which
    lets a learner step skip its proximal pass (`learner.bypass`), or None where it cannot say so.

    The sync pipeline pushes v`version` after each step and every worker acknowledges it by digests of the
    weights its engine holds (a new or replaced worker loads and acknowledges it before its first sample),
    so the next batch is sampled on exactly the learner's weights. Not vouched: the async pipeline (samples
    of older versions), a rollout dtype other than the learner's (other numerics), an environment or agent
    sessions (tokens the learner sees may be re-rendered), or `learner.proximal_pass: always`."""
    sync = cfg.pipeline.mode == "sync"  # (partial rollouts are async only: the run config refuses them here)
    same = cfg.rollout.dtype == cfg.learner.dtype and not cfg.episodes
    return version if sync and same and cfg.learner.proximal_pass == "auto" else None


class LearnerRanks:
    """Learner steps over the run's ranks (`roles.ranks`; colocated hosts in `roles.hosts`).
    `resume_hint()` is the tail of a stopping error: how to continue the run."""

    def __init__(self, cfg: RunConfig, roles: Roles, resume_hint: Callable[[], str]) -> None:
        self.cfg, self.roles, self.resume_hint = cfg, roles, resume_hint

    def train_calls(self, parts: Parts, engines_hold: int | None = None) -> list[tuple[str, Any, list]]:
        """Start a learner step on `parts` (both pipelines): each rank gets its shard as object
        references with (position, score, group) triples (`RankPart`s) and assembles its trajectories itself
        (`train_parts`), so no sample passes through the driver. Returns per rank (its name, the
        call's reference, the chunk of each of its parts)."""
        shards = shard_parts(parts, len(self.roles.ranks), self.cfg.learner.balance_ranks)
        return [
            (LEARNER.member_name(i), rank.train_parts.remote(args, engines_hold), chunks)
            for i, (rank, (args, chunks)) in enumerate(zip(self.roles.ranks, shards, strict=True))
        ]

    def learn(
        self,
        batch: RolloutBatch,
        step: int,
        regather: Callable[[RolloutBatch, set[int]], None],
        version: int | None = None,
    ) -> dict:
        """Sync: train every rank on `batch` (step `step`). An input lost with its node (the ranks agree on
        it before their first collective, so none trained) is generated and scored again by `regather`,
        same seeds, and the step retried, as the async pipeline does; that time counts as training time.
        `version`: the weights every worker acknowledged holding (`engines_hold`)."""
        held = None if version is None else engines_hold(self.cfg, version)
        # colocated: each host's rollout engine frees its memory before its rank trains (same actor,
        # so it runs first); a no-op unless rollout.sleep_level > 0
        sleeps = [h.sleep_rollout.remote() for h in self.roles.hosts]
        while True:
            calls = self.train_calls(batch.parts, held)
            results = self._results({ref: name for name, ref, _chunks in calls}, step)
            lost = {
                chunks[k].index
                for _n, ref, chunks in calls
                if isinstance(results[ref], LostInputs)
                for k in results[ref].parts
            }
            if not lost:
                break
            regather(batch, lost)
        # done before the steps (same actors): raises if an engine failed to sleep
        ray.get(sleeps, timeout=self.cfg.timeouts.train_s)
        return results[calls[0][1]]

    def value(self, ref: Any, name: str, step: int) -> Any:
        """The answer of rank `name`'s finished call `ref` in step `step`, or the error that stops the run."""
        resume = self.resume_hint()
        try:
            return ray.get(ref)
        except DEAD_ACTOR_ERRORS as err:
            raise LearnerStepError(f"{name} died during step {step}{resume}") from err
        except ray.exceptions.RayTaskError as err:
            raise LearnerStepError(f"{name} failed: {err.cause!r}{resume}") from err
        except ray.exceptions.RayError as err:
            raise LearnerStepError(f"{name} died during step {step}{resume}") from err

    def _results(self, names: dict[Any, str], step: int) -> dict[Any, dict]:
        """The value of each rank's call (`names`: reference -> rank name) within timeouts.train_s."""
        pending, results = list(names), {}
        limit = self.cfg.timeouts.train_s
        deadline = time.monotonic() + limit
        while pending:
            ready, pending = wait_until(pending, 1, deadline)
            if not ready:
                raise LearnerStepError(
                    f"learner step not done within {limit:.0f}s (timeouts.train_s){self.resume_hint()}"
                )
            results[ready[0]] = self.value(ready[0], names[ready[0]], step)
        return results
