"""One rollout batch: generate in chunks across workers, score each chunk as soon as it lands.

Scoring (reference logprobs and reward) of finished chunks overlaps the generation of the
others. A sample whose reward failed is dropped and counted; nothing is silently scored 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from learner.batch import Trajectory
from rollout_workers.types import Sample

from .data import Prompt


class RolloutTimeout(TimeoutError):
    """A remote call exceeded its configured timeout; the message names the actor."""


@dataclass
class RolloutBatch:
    samples: list[Sample]
    trajectories: list[Trajectory]
    scores: np.ndarray  # of kept samples
    dropped: int = 0
    reward_errors: list[str] = field(default_factory=list)
    time_generate: float = 0.0
    time_score: float = 0.0


def chunk_seed(run_seed: int, step: int, chunk: int) -> int:
    """Sampling seed that depends only on (run, step, chunk), not on which worker runs it."""
    return int(np.random.SeedSequence([run_seed, step, chunk]).generate_state(1)[0])


def _wait_all(refs: list[Any], names: dict[Any, str], timeout: float, what: str) -> list[Any]:
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if pending:
        late = sorted({names[r] for r in pending})
        raise RolloutTimeout(f"{what} not done within {timeout:.0f}s; stuck: {', '.join(late)}")
    return ray.get(refs)


def collect_rollout(
    prompts: list[Prompt],
    step: int,
    run_seed: int,
    chunk_size: int,
    workers: list[Any],
    worker_names: list[str],
    references: list[Any],
    scorers: list[Any],
    generate_timeout: float,
    score_timeout: float,
) -> RolloutBatch:
    t0 = time.perf_counter()
    by_index = {p.index: p for p in prompts}
    names: dict[Any, str] = {}
    gen_refs = []
    for ci, start in enumerate(range(0, len(prompts), chunk_size)):
        chunk = prompts[start : start + chunk_size]
        w = ci % len(workers)
        ref = workers[w].generate.remote(
            [p.index for p in chunk], [p.ids for p in chunk], chunk_seed(run_seed, step, ci)
        )
        gen_refs.append(ref)
        names[ref] = worker_names[w]

    order = {ref: i for i, ref in enumerate(gen_refs)}
    chunk_samples: list[list[Sample] | None] = [None] * len(gen_refs)
    score_jobs: list[tuple[int, Any, Any]] = []
    pending = list(gen_refs)
    deadline = time.monotonic() + generate_timeout
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = sorted({names[r] for r in pending})
            raise RolloutTimeout(
                f"generate not done within {generate_timeout:.0f}s (timeouts.generate_s); stuck: {', '.join(late)}"
            )
        ref = ready[0]
        i = order[ref]
        samples = ray.get(ref)
        chunk_samples[i] = samples
        p_ids = [s.prompt_ids for s in samples]
        r_ids = [s.response_ids for s in samples]
        meta = [by_index[s.prompt_index].meta for s in samples]
        ref_actor = references[i % len(references)]
        scorer = scorers[i % len(scorers)]
        lp_ref = ref_actor.logprobs.remote(p_ids, r_ids)
        sc_ref = scorer.score.remote(p_ids, r_ids, meta)
        names[lp_ref] = f"reference-{i % len(references)}"
        names[sc_ref] = f"reward-scorer-{i % len(scorers)}"
        score_jobs.append((i, lp_ref, sc_ref))
    t_gen = time.perf_counter() - t0

    refs = [r for _, a, b in score_jobs for r in (a, b)]
    results = _wait_all(refs, names, score_timeout, "scoring (timeouts.score_s)")
    by_chunk = {}
    for k, (i, _, _) in enumerate(score_jobs):
        by_chunk[i] = (results[2 * k], results[2 * k + 1])

    kept: list[Sample] = []
    trajectories: list[Trajectory] = []
    scores: list[float] = []
    dropped, errors = 0, []
    for i, samples in enumerate(chunk_samples):
        ref_lps, score_batch = by_chunk[i]
        for j, s in enumerate(samples or []):
            if not score_batch.ok[j]:
                dropped += 1
                errors.append(score_batch.errors[j] or "unknown reward error")
                continue
            kept.append(s)
            scores.append(float(score_batch.scores[j]))
            trajectories.append(
                Trajectory(
                    prompt_ids=s.prompt_ids,
                    response_ids=s.response_ids,
                    behaviour_logprobs=s.logprobs,
                    ref_logprobs=ref_lps[j],
                    score=float(score_batch.scores[j]),
                    policy_version=s.policy_version,
                )
            )
    return RolloutBatch(
        samples=kept,
        trajectories=trajectories,
        scores=np.asarray(scores, dtype=np.float64),
        dropped=dropped,
        reward_errors=errors,
        time_generate=t_gen,
        time_score=time.perf_counter() - t0 - t_gen,
    )
