"""The role actors on Ray (placed by `cluster.placement`), with readable names for the dashboard's Actors view.

Every actor's Ray name is `<run id>/<member name>` (`actor_name`), e.g.
`sentiment_tiny-20260101-120000/rollout-worker-0.r1`: two runs on one cluster stay apart in the
Actors view (sort or filter by name). The pools keep the short member names for logs and errors.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from learner.batch import Trajectory
from learner.rank import LearnerRank
from reward_service.reference import ReferencePolicy
from reward_service.scorer import RewardScorer
from rollout_workers.worker import RolloutWorker

from .config import RunConfig
from .placement import PlacementPlan
from .pools import ActorPool, ActorStartError, wait_ready, wait_until

# Quiet, single-threaded tokenizers and no per-actor progress bars in the driver's log stream.
ACTOR_ENV = {
    "runtime_env": {
        "env_vars": {
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
        }
    }
}


# ---------------------------------------------------------------------------------------------
# Streaming adapters. In async mode samples travel between actors as object references, never
# through the driver: a worker returns (small per-sample facts, samples) as two objects, and the
# reference, the scorer and the learner read the samples object themselves. The roles keep their
# own interfaces; converting one role's records into the next one's input is cluster/'s job, so it
# lives in these thin subclasses (the Ray actor classes of every mode).
# ---------------------------------------------------------------------------------------------


class StreamingRolloutWorker(RolloutWorker):
    @ray.method(num_returns=2)
    def generate_chunk(
        self, prompt_indices: list[int], prompts: list, seed: int, sampling: Any = None
    ) -> tuple[list[tuple], list]:
        """`generate`, returned as (facts per sample: prompt index, version, length, finish reason;
        the samples). The driver fetches only the facts."""
        samples = self.generate(prompt_indices, prompts, seed, sampling)
        facts = [(s.prompt_index, s.policy_version, len(s.response_ids), s.finish_reason) for s in samples]
        return facts, samples


class StreamingReference(ReferencePolicy):
    def sample_logprobs(self, samples: list) -> list:
        return self.logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])


class StreamingScorer(RewardScorer):
    def score_samples(self, samples: list, meta_by_prompt: dict[int, dict]) -> Any:
        return self.score(
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            [meta_by_prompt[s.prompt_index] for s in samples],
        )


class StreamingLearnerRank(LearnerRank):
    def train_parts(self, parts: list[tuple[Any, Any, list[tuple[int, float, int]]]]) -> dict[str, float]:
        """`train_step` on trajectories assembled here from object references: each part is
        (samples ref, reference-logprobs ref, [(sample position, score, group id), ...])."""
        trajectories = []
        for samples_ref, ref_lp_ref, picks in parts:
            samples, ref_lps = ray.get([samples_ref, ref_lp_ref])
            trajectories += [to_trajectory(samples[j], ref_lps[j], score, g) for j, score, g in picks]
        return self.train_step(trajectories)


def to_trajectory(sample: Any, ref_logprobs: Any, score: float, group: int = -1) -> Trajectory:
    """The learner's record of one scored rollout sample; `group` is shared by the samples of one prompt."""
    return Trajectory(
        prompt_ids=sample.prompt_ids,
        response_ids=sample.response_ids,
        behaviour_logprobs=sample.logprobs,
        ref_logprobs=ref_logprobs,
        score=float(score),
        policy_version=sample.policy_version,
        group=int(group),
        truncated=sample.finish_reason == "length",
    )


def actor_name(run_id: str, member: str) -> str:
    """The Ray actor name of a run's member: `<run id>/<member>`."""
    return f"{run_id}/{member}"


@dataclass
class Roles:
    workers: ActorPool
    references: ActorPool
    scorers: ActorPool
    plan: PlacementPlan
    ranks: list[Any] = field(default_factory=list)

    def pools(self) -> list[ActorPool]:
        return [self.workers, self.references, self.scorers]


def make_pools(
    cfg: RunConfig,
    plan: PlacementPlan,
    run_id: str,
    on_worker_start: Callable[[Any, str], None] | None = None,
) -> Roles:
    """Pools for the scalable roles, placed by `plan`; actors start when the pools grow."""
    ref, rew = cfg.reference, cfg.reward
    temperature = cfg.rollout.sampling.temperature
    wait = cfg.timeouts.actor_start_s

    def worker(name: str, slot: int) -> Any:
        return (
            ray.remote(StreamingRolloutWorker)
            .options(name=actor_name(run_id, name), **plan.options("rollout", slot), **ACTOR_ENV)
            .remote(cfg.model.policy_path, plan.rollout.config, slot, 0)
        )

    def reference(name: str, slot: int) -> Any:
        return (
            ray.remote(StreamingReference)
            .options(name=actor_name(run_id, name), **plan.options("reference", slot), **ACTOR_ENV)
            .remote(cfg.reference_path, ref, temperature)
        )

    def scorer(name: str, slot: int) -> Any:
        return (
            ray.remote(StreamingScorer)
            .options(name=actor_name(run_id, name), **plan.options("reward", slot), **ACTOR_ENV)
            .remote(rew, cfg.tokenizer_path)
        )

    def pool(role: str, start: Callable[[str, int], Any], on_start: Callable | None = None) -> ActorPool:
        release = functools.partial(plan.release, role)
        return ActorPool(plan.shapes[role].prefix, start, wait, on_start, release=release)

    return Roles(
        workers=pool("rollout", worker, on_worker_start),
        references=pool("reference", reference),
        scorers=pool("reward", scorer),
        plan=plan,
    )


def start_learner(cfg: RunConfig, roles: Roles, pad_token_id: int, run_id: str) -> None:
    """N ranks in the plan's bundles, joined into one torch.distributed world."""
    lc = cfg.learner
    wait = cfg.timeouts.actor_start_s
    names = [f"{roles.plan.shapes['learner'].prefix}-{rank}" for rank in range(lc.num_ranks)]
    for rank, name in enumerate(names):
        roles.ranks.append(
            ray.remote(StreamingLearnerRank)
            .options(name=actor_name(run_id, name), **roles.plan.options("learner", rank), **ACTOR_ENV)
            .remote(
                rank,
                lc.num_ranks,
                cfg.model.policy_path,
                lc,
                cfg.run.seed,
                pad_token_id,
                cfg.rollout.sampling.temperature,
            )
        )
    wait_ready(roles.ranks, names, wait)
    addr, port = ray.get(roles.ranks[0].node_address.remote(), timeout=wait)
    setups = [r.setup.remote(addr, port) for r in roles.ranks]
    _, pending = wait_until(setups, len(setups), time.monotonic() + wait)
    if pending:
        raise ActorStartError(f"learner ranks did not form a process group within {wait:.0f}s")
    ray.get(setups)


def start_roles(cfg: RunConfig, pad_token_id: int, run_id: str, on_worker_start=None) -> Roles:
    """Reserve the whole placement plan first (it fails fast when the cluster cannot hold it), then
    start every actor at once (model loading overlaps); the learner's rendezvous runs meanwhile."""
    plan = PlacementPlan(cfg)
    plan.reserve()
    roles = make_pools(cfg, plan, run_id, on_worker_start)
    try:
        counts = (cfg.rollout.num_workers, cfg.reference.num_replicas, cfg.reward.num_replicas)
        launched = [pool.launch(n) for pool, n in zip(roles.pools(), counts, strict=True)]
        start_learner(cfg, roles, pad_token_id, run_id)
        for pool, started in zip(roles.pools(), launched, strict=True):
            pool.admit(started)
    except BaseException:
        stop_roles(roles)
        raise
    return roles


def stop_roles(roles: Roles) -> None:
    for rank in roles.ranks:
        # best effort: the actor is killed next anyway
        with contextlib.suppress(Exception):
            ray.get(rank.shutdown.remote(), timeout=30)
    for rank in roles.ranks:
        with contextlib.suppress(Exception):
            ray.kill(rank, no_restart=True)
    for pool in roles.pools():
        pool.kill_all()
    roles.plan.remove()
