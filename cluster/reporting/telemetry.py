"""Live run metrics through `ray.util.metrics`, for the Ray dashboard's Metrics view and Prometheus.

`metrics.jsonl` and TensorBoard are the run's record; this is the live view of a run on a shared
cluster. Ray prefixes every custom metric with `ray_` and exports it from each node's metrics
port (`ray.nodes()[i]["MetricsExportPort"]`, Prometheus text at `/metrics`) about every 10 s;
counters get a `_total` suffix. `cluster/dashboards/rayppo.json` is the Grafana dashboard of these
series and `python -m cluster.watch` a Prometheus that scrapes them. Telemetry never stops a run:
when Ray metrics are missing or a record fails, it warns once and turns itself off.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from cluster.roles.registry import ROLES

logger = logging.getLogger(__name__)

# trainer metric key -> (gauge name, description); the gauge holds the latest step's value.
# Every name here is queried by a panel of cluster/dashboards/rayppo.json (tests/test_watch.py checks).
GAUGES: dict[str, tuple[str, str]] = {
    "rollout/reward_mean": (
        "rayppo_reward_mean",
        "Mean reward of the step's samples (before the KL penalty).",
    ),
    "eval/reward_mean": (
        "rayppo_eval_reward_mean",
        "Mean reward on held-out prompts (when the run evaluates).",
    ),
    "eval/accuracy": (
        "rayppo_eval_accuracy",
        "Accuracy on held-out prompts (rule rewards, when the run evaluates).",
    ),
    "objective/kl": ("rayppo_kl", "Mean per-sequence KL of the policy to the reference."),
    "objective/kl_coef": ("rayppo_kl_coef", "KL coefficient beta used for the step."),
    "policy_version": ("rayppo_policy_version", "Policy version the learner has published."),
    "throughput/samples_per_s": ("rayppo_samples_per_second", "Samples per wall second of the step."),
    "throughput/tokens_per_s": ("rayppo_tokens_per_second", "Generated tokens per wall second of the step."),
    "rollout/queue_depth": (
        "rayppo_trajectory_queue_depth",
        "Scored trajectories (or, async, buffered prompts) waiting for the learner when the step began.",
    ),
    "rollout/staleness_mean": (
        "rayppo_sample_staleness",
        "Mean policy versions between sampling and training of the step's samples.",
    ),
    "eval/response_length": (
        "rayppo_eval_response_length",
        "Mean response length in tokens on held-out prompts (when the run evaluates).",
    ),
    "staleness/max": (
        "rayppo_sample_staleness_max",
        "Largest policy-version lag of a sample trained in the step (async).",
    ),
    "time/weight_sync": ("rayppo_weight_sync_seconds", "Seconds to export and load the new weights."),
    "pipeline/generator_idle_frac": (
        "rayppo_generator_idle_fraction",
        "Fraction of the step's wall time the rollout workers had no generate call running (async).",
    ),
    "pipeline/learner_idle_frac": (
        "rayppo_learner_idle_fraction",
        "Fraction of the step's wall time the learner waited for a full batch (async).",
    ),
    "scale/rollout_workers": ("rayppo_rollout_workers", "Live rollout workers at the end of the step."),
    "off_policy/weight_mean": ("rayppo_off_policy_weight_mean", "Mean behaviour/proximal correction weight."),
    "off_policy/clipped_frac": (
        "rayppo_off_policy_clipped_fraction",
        "Fraction of tokens whose correction weight was capped or masked.",
    ),
    "off_policy/behaviour_kl": ("rayppo_behaviour_kl", "KL(behaviour || proximal policy) per token (k3)."),
}

# trainer timing key -> role tag of the busy-time gauge
ROLE_BUSY: dict[str, str] = {r.busy_metric: r.name for r in ROLES if r.busy_metric}

# trainer per-step count -> (gauge name, description). The gauge holds the total since the driver
# started, set every step: a healthy run shows 0 from its first step (a Ray Counter cannot be
# incremented by 0, so it would export nothing until the first fault), and no scrape loses a count.
TOTALS: dict[str, tuple[str, str]] = {
    "rollout/reward_failures": ("rayppo_reward_failures", "Samples dropped because their reward failed."),
    "train/skipped_steps": ("rayppo_skipped_steps", "Optimizer steps skipped (non-finite gradients)."),
    "faults/actor_replacements": ("rayppo_actor_replacements", "Dead or stuck role actors replaced."),
    "faults/redispatched_chunks": (
        "rayppo_redispatched_chunks",
        "Chunks of work sent again after their actor died or timed out.",
    ),
    "staleness/dropped_samples": (
        "rayppo_stale_samples_dropped",
        "Samples dropped for exceeding pipeline.max_staleness (their prompts are re-queued).",
    ),
}

STEP_SECONDS_BOUNDARIES = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0]


class Telemetry:
    """Exports one run's step metrics as Ray gauges, counters and histograms.

    Every series carries the tag `run=<run id>` (the run folder's name, or the job's submission
    id), so runs sharing a cluster stay apart; the dashboard's `run` variable selects one.
    Gauges hold the latest step's value. Ray keeps a gauge in its export for two export periods
    (about 20 s) after each set, so a run whose steps take longer shows one short stretch of
    samples per step with gaps between them (the dashboard's panels join the points; "the latest
    value" is `last_over_time(...)`), and steps faster than the export period are sampled. What must count every step exactly once is cumulative:
    the counters `rayppo_steps_total` and `rayppo_samples_total`, the fault totals and
    `rayppo_reward_sum` (the steps' mean rewards added up), so `delta(reward_sum) / increase(steps)`
    over any window is the exact mean per step. (Not a histogram: Ray's histogram `_sum` adds
    bucket midpoints, not the observed values; `rayppo_step_seconds` is read through its buckets.)
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.enabled = False
        self._tags = {"run": run_id}
        self._gauges: dict[str, Any] = {}
        self._totals: dict[str, Any] = {}
        self._sums: dict[str, float] = dict.fromkeys(TOTALS, 0.0)
        self._rewards = 0.0
        try:
            from ray.util.metrics import Counter, Gauge, Histogram

            for key, (name, desc) in GAUGES.items():
                self._gauges[key] = Gauge(name, description=desc, tag_keys=("run",))
            for key, (name, desc) in TOTALS.items():
                self._totals[key] = Gauge(
                    name, description=desc + " Total since the driver started.", tag_keys=("run",)
                )
            self._lag = Gauge(
                "rayppo_worker_version_lag",
                description="Policy versions a rollout worker trails the learner (async mode), per worker.",
                tag_keys=("run", "worker"),
            )
            self._busy = Gauge(
                "rayppo_role_busy_seconds",
                description="Seconds a role was busy during the step (rollout, reward, learner).",
                tag_keys=("run", "role"),
            )
            self._samples = Counter("rayppo_samples", description="Samples trained on.", tag_keys=("run",))
            self._steps = Counter("rayppo_steps", description="PPO iterations completed.", tag_keys=("run",))
            self._step_time = Histogram(
                "rayppo_step_seconds",
                description="Wall seconds per PPO iteration.",
                boundaries=STEP_SECONDS_BOUNDARIES,
                tag_keys=("run",),
            )
            self._reward_sum = Gauge(
                "rayppo_reward_sum",
                description="The steps' mean rewards added up since the driver started (one term per step).",
                tag_keys=("run",),
            )
            self.enabled = True
        except Exception as err:  # metrics must never stop a run
            logger.warning("telemetry off: Ray metrics unavailable (%s)", err)

    def record_step(self, metrics: dict[str, float], worker_lags: dict[str, int] | None = None) -> None:
        """Export one iteration's metrics (the trainer's keys; missing ones are skipped).
        `worker_lags` (async): versions each rollout worker trails, one series per worker."""
        if not self.enabled:
            return
        try:
            self._record(metrics)
            for worker, lag in (worker_lags or {}).items():
                self._lag.set(float(lag), tags={**self._tags, "worker": worker})
        except Exception as err:
            self.enabled = False
            logger.warning("telemetry off after a failed record (%s)", err)

    def record_eval(self, metrics: dict[str, float]) -> None:
        """Export an evaluation made outside a step (before the first, after the last): eval gauges only."""
        if self.enabled:
            try:
                for key, gauge in self._gauges.items():
                    value = _finite(metrics.get(key)) if key.startswith("eval/") else None
                    if value is not None:
                        gauge.set(value, tags=self._tags)
            except Exception as err:
                self.enabled = False
                logger.warning("telemetry off after a failed record (%s)", err)

    def _record(self, metrics: dict[str, float]) -> None:
        tags = self._tags
        for key, gauge in self._gauges.items():
            value = _finite(metrics.get(key))
            if value is not None:
                gauge.set(value, tags=tags)
        for key, role in ROLE_BUSY.items():
            value = _finite(metrics.get(key))
            if value is not None:
                self._busy.set(value, tags={**tags, "role": role})
        for key, gauge in self._totals.items():
            value = _finite(metrics.get(key))
            if value is not None and value > 0:
                self._sums[key] += value
            gauge.set(self._sums[key], tags=tags)
        samples = _finite(metrics.get("rollout/samples"))
        if samples is not None and samples > 0:
            self._samples.inc(samples, tags=tags)
        step_s = _finite(metrics.get("time/step"))
        if step_s is not None and step_s >= 0:
            self._step_time.observe(step_s, tags=tags)
        reward = _finite(metrics.get("rollout/reward_mean"))
        if reward is not None:
            self._rewards += reward
            self._reward_sum.set(self._rewards, tags=tags)
        self._steps.inc(1.0, tags=tags)


def _finite(value: Any) -> float | None:
    """Non-finite values are skipped: Ray drops NaN gauge points, and a NaN would hide the last good one."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
