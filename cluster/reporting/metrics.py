"""Per-step metrics: what a trained step reports (`sample_metrics`, `step_metrics`: both pipelines build their rows with it); the run's
loggers (`cluster.reporting.trackers`) write them, `metrics.jsonl` first."""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.records.chunks import Parts, kept
from cluster.reporting.flat_groups import METRIC as FLAT_METRIC
from cluster.reporting.flat_groups import flat_groups_frac
from kernel.metric_names import merge_metrics
from reward_service.backends import reward_to_prob
from rollout_workers.environment import FAILED, EpisodeStatus


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def held_out_only(row: Mapping[str, Any]) -> bool:
    """Is this metrics.jsonl row a held-out evaluation alone, no training step (`StepRow.held_out_only`)?
    Two are: step 0's, of the initial weights, and the final weights' at the last step, written after
    that step's training row. Such a row holds eval/* metrics and time/eval only; a training row always
    holds its samples' rollout/* metrics."""
    return all(k == "step" or k == "time/eval" or k.startswith("eval/") for k in row)


def truncate_metrics(path: str | Path, last_step: int) -> list[dict[str, float]]:
    """Keep only rows up to `last_step` (a resumed run rewrites what came after its checkpoint). A finished
    run's final held-out evaluation at `last_step` stays, as it stays in the trackers (MLflow keeps every
    value it was given): a finished run resumed to end again writes its own after it, the later row of
    the step, as MLflow's later value is."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = [r for r in read_metrics(path) if r["step"] <= last_step]
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
    return rows


def sample_metrics(parts: Parts, wall: float, data_stats: Any, reward: Any) -> dict[str, float]:
    """The metrics of a step's samples (`parts`, as the learner took them) and of the data, the same in
    both pipelines: from the chunks' facts and scores, never the samples themselves. A sample's reward is
    its return (`ScoreBatch.returns`, what the learner trains on). `reward` is the run's reward section
    (how a score maps to a probability, when it does)."""
    trained = kept(parts)
    scores = np.array([float(c.scores.returns[j]) for c, j in trained])
    lengths = np.array([c.facts[j].length for c, j in trained])
    finish = [c.facts[j].finish_reason for c, j in trained]
    failures = sum(len(pos) for _c, pos in parts) - len(trained)
    m = {
        **function_metrics(trained),
        **function_failure_metrics(parts),
        "rollout/reward_mean": float(scores.mean()),
        "rollout/reward_std": float(scores.std()),
        "rollout/response_length": float(lengths.mean()),
        "rollout/truncated_frac": float(np.mean([f == "length" for f in finish])),
        "rollout/samples": float(len(scores)),
        "rollout/reward_failures": float(failures),
        "throughput/tokens_per_s": float(lengths.sum()) / wall,
        "throughput/samples_per_s": len(scores) / wall,
        "data/empty_prompts": float(data_stats.empty),
        "data/truncated_prompts": float(data_stats.truncated),
        "data/skipped_prompts": float(data_stats.skipped_long),
    }
    probs = reward_to_prob(scores, reward)
    if probs is not None:
        m["rollout/reward_prob_mean"] = float(probs.mean())
    if (flat := flat_groups_frac(parts)) is not None:
        m[FLAT_METRIC] = flat
    m.update(episode_metrics([c.facts[j] for c, pos in parts for j in pos]))
    return m


def function_metrics(scored: list[tuple[Any, int]], prefix: str = "") -> dict[str, float]:
    """reward/<name>: each reward function's own value (unweighted; `ScoreBatch.function_values`), the mean
    over `scored`, the (chunk, position) of samples whose reward succeeded. Empty without reward functions."""
    names = sorted({name for c, _j in scored for name in c.scores.function_values})
    return {
        f"{prefix}reward/{name}": float(np.mean([c.scores.function_values[name][j] for c, j in scored]))
        for name in names
    }


def function_failure_metrics(parts: Parts, prefix: str = "") -> dict[str, float]:
    """reward_failures/<name>: the samples of `parts` each reward function failed on (it raised, hung or
    gave no finite number; `ScoreBatch.function_failures`), 0 where it failed on none. Empty without reward
    functions."""
    names = sorted({name for c, _pos in parts for name in c.scores.function_failures})
    # every chunk of a run's parts was scored by the same functions
    return {
        f"{prefix}reward_failures/{name}": float(
            sum(bool(c.scores.function_failures[name][j]) for c, pos in parts for j in pos)
        )
        for name in names
    }


def version_metrics(facts: list[Any], version: int) -> dict[str, float]:
    """How the trained samples' tokens spread over policy versions (`SampleFacts.spans`), for a learner
    at `version`: versions per response, the share of responses whose generation new weights cut into,
    the segments after the first summed over the batch (`pipeline.partial_rollout`), and the mean lag
    of a token (a sample's own staleness is its oldest token's: `rollout/staleness_mean`)."""
    spans = [f.spans or ((f.version, f.length),) for f in facts]
    if not spans:
        return {}
    tokens = sum(c for s in spans for _v, c in s)
    return {
        "staleness/versions_per_response": float(np.mean([len(s) for s in spans])),
        "staleness/interrupted_frac": float(np.mean([len(s) > 1 for s in spans])),
        "staleness/interrupted_segments": float(sum(len(s) - 1 for s in spans)),
        "staleness/token_lag_mean": float(
            sum((version - v) * c for s in spans for v, c in s) / max(tokens, 1)
        ),
    }


EPISODE_STATUSES = typing.get_args(EpisodeStatus)


def episode_metrics(facts: list[Any], prefix: str = "") -> dict[str, float]:
    """env/* metrics of the multi-turn episodes among `facts` (SampleFacts), failed ones included:
    turns, model and observation tokens and environment seconds per episode, the environment's counters
    per episode (e.g. env/tool_calls) and the share of episodes with one (env/tool_calls_rate), episodes
    ended by each status (env/status/*: the failed ones are env_error and env_timeout) and the failures'
    total (env/failures).
    Empty when no sample is an episode."""
    episodes = [f.episode for f in facts if f.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    m = {
        "env/episodes": float(n),
        "env/turns": float(np.mean([e.turns for e in episodes])),
        "env/model_tokens": float(np.mean([e.model_tokens for e in episodes])),
        "env/observation_tokens": float(np.mean([e.env_tokens for e in episodes])),
        "env/seconds": float(np.mean([e.env_s for e in episodes])),
        "env/busy_s": float(sum(e.env_s for e in episodes)),
    }
    for status in EPISODE_STATUSES:
        m[f"env/status/{status}"] = float(sum(e.status == status for e in episodes))
    m["env/failures"] = sum(m[f"env/status/{s}"] for s in sorted(FAILED))
    for key in sorted({k for e in episodes for k in e.info}):
        values = [float(e.info.get(key, 0.0)) for e in episodes]
        m[f"env/{key}"] = float(np.mean(values))
        m[f"env/{key}_rate"] = float(np.mean([v > 0 for v in values]))
    return {f"{prefix}{k}": v for k, v in m.items()}


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one step's phases."""

    generate: float  # the workers' generation (async: the busy time per worker)
    score: float  # scoring not hidden behind generation
    train: float  # the learner's step, as the driver waited for it
    weight_sync: float
    wall: float


@dataclass(frozen=True)
class StepFaults:
    replacements: int  # actors lost and replaced during the step
    redispatched: int  # chunks handed to another actor
    lost: int  # chunks whose objects were lost with their node and generated again


def step_metrics(
    parts: Parts,
    learner: dict[str, float],
    times: StepTimes,
    faults: StepFaults,
    staleness: list[int],
    *,
    data_stats: Any,
    reward: Any,
    version: int,
    workers: int,
    own: dict[str, float],
) -> dict[str, float]:
    """The row of a step, built the same way by both pipelines: its samples' metrics, its times, versions
    and faults, the pipeline's `own` metrics (sync: the scoring queue; async: the buffer, the staleness
    histogram, idle fractions) and the learner's. `version` is the one just published; `staleness` each
    trained sample's versions behind it. A name produced twice is an error (`merge_metrics`)."""
    return merge_metrics(
        sample_metrics(parts, times.wall, data_stats, reward),
        {
            "rollout/staleness_mean": float(np.mean(staleness)),
            "time/generate": times.generate,
            "time/score": times.score,
            "time/train": times.train,
            "time/weight_sync": times.weight_sync,
            "time/step": times.wall,
            "policy_version": float(version),
            "scale/rollout_workers": float(workers),
            "faults/actor_replacements": float(faults.replacements),
            "faults/redispatched_chunks": float(faults.redispatched),
            "faults/lost_chunks": float(faults.lost),
        },
        own,
        learner,
    )
