"""Live run metrics through `ray.util.metrics`, for the Ray dashboard's Metrics view and Prometheus.

`metrics.jsonl` and TensorBoard are the run's record; this is the live view of a run on a shared
cluster. Ray prefixes every custom metric with `ray_` and exports it from each node's metrics
port (`ray.nodes()[i]["MetricsExportPort"]`, Prometheus text at `/metrics`) about every 10 s;
counters get a `_total` suffix. Telemetry never stops a run: when Ray metrics are missing or a
record fails, it warns once and turns itself off.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "rayppo_"

# controller metric key -> (gauge name, description)
GAUGES: dict[str, tuple[str, str]] = {
    "rollout/reward_mean": (
        "rayppo_reward_mean",
        "Mean reward of the step's samples (before the KL penalty).",
    ),
    "objective/kl": ("rayppo_kl", "Mean per-sequence KL of the policy to the reference."),
    "objective/kl_coef": ("rayppo_kl_coef", "KL coefficient beta used for the step."),
    "policy_version": ("rayppo_policy_version", "Policy version loaded by the rollout workers."),
    "throughput/samples_per_s": ("rayppo_samples_per_second", "Samples per wall second of the step."),
    "throughput/tokens_per_s": ("rayppo_tokens_per_second", "Generated tokens per wall second of the step."),
    "rollout/queue_depth": (
        "rayppo_trajectory_queue_depth",
        "Scored trajectories (or chunks) waiting for the learner.",
    ),
    "rollout/staleness_mean": (
        "rayppo_sample_staleness",
        "Mean policy versions between sampling and training of the step's samples.",
    ),
    "time/weight_sync": ("rayppo_weight_sync_seconds", "Seconds to export and load the new weights."),
    # held-out evaluation (the eval: section), on prompts never trained on
    "eval/reward_mean": ("rayppo_eval_reward_mean", "Mean reward on the held-out prompts."),
    "eval/accuracy": (
        "rayppo_eval_accuracy",
        "Share of held-out responses whose rule reward is at least eval.correct_at.",
    ),
    "eval/response_length": ("rayppo_eval_response_length", "Mean held-out response length in tokens."),
    # streaming (pipeline.mode=async)
    "staleness/max": (
        "rayppo_sample_staleness_max",
        "Largest policy-version lag of a sample trained in the step.",
    ),
    "pipeline/buffer_depth": (
        "rayppo_buffer_depth",
        "Scored prompts in the trajectory buffer when the step began.",
    ),
    "pipeline/generator_idle_frac": (
        "rayppo_generator_idle_fraction",
        "Fraction of the step's wall time the rollout workers had no generate call running.",
    ),
    "pipeline/learner_idle_frac": (
        "rayppo_learner_idle_fraction",
        "Fraction of the step's wall time the learner waited for a full batch.",
    ),
    "weights/version_lag_max": (
        "rayppo_worker_version_lag_max",
        "Versions the furthest-behind rollout worker trails the learner at the end of the step.",
    ),
    "off_policy/weight_mean": ("rayppo_off_policy_weight_mean", "Mean behaviour/proximal correction weight."),
    "off_policy/clipped_frac": (
        "rayppo_off_policy_clipped_fraction",
        "Fraction of tokens whose correction weight was capped or masked.",
    ),
    "off_policy/behaviour_kl": ("rayppo_behaviour_kl", "KL(behaviour || proximal policy) per token (k3)."),
}

# controller timing key -> role tag of the busy-time gauge
ROLE_BUSY: dict[str, str] = {"time/generate": "rollout", "time/score": "reward", "time/train": "learner"}

# controller per-step count -> (counter name, description); exported as <name>_total
COUNTERS: dict[str, tuple[str, str]] = {
    "rollout/reward_failures": ("rayppo_reward_failures", "Samples dropped because their reward failed."),
    "train/skipped_steps": ("rayppo_skipped_steps", "Optimizer steps skipped (non-finite gradients)."),
    "rollout/samples": ("rayppo_samples", "Samples trained on."),
    "staleness/dropped_samples": (
        "rayppo_stale_samples_dropped",
        "Samples dropped for exceeding pipeline.max_staleness (their prompts are re-queued).",
    ),
}

STEP_SECONDS_BOUNDARIES = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0]

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """A Prometheus-safe name for a free-form key: 'eval/acc@1' -> 'rayppo_eval_acc_1'."""
    return PREFIX + _NAME_BAD.sub("_", key).strip("_")


class Telemetry:
    """Exports one run's step metrics as Ray gauges, counters and a step-time histogram.

    Every series carries the tag `run=<run_name>`, so runs sharing a cluster stay apart.
    """

    def __init__(self, run_name: str) -> None:
        self.run_name = run_name
        self.enabled = False
        self._tags = {"run": run_name}
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, Any] = {}
        self._extra: dict[str, Any] = {}
        try:
            from ray.util.metrics import Counter, Gauge, Histogram

            self._Gauge = Gauge
            for key, (name, desc) in GAUGES.items():
                self._gauges[key] = Gauge(name, description=desc, tag_keys=("run",))
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
            for key, (name, desc) in COUNTERS.items():
                self._counters[key] = Counter(name, description=desc, tag_keys=("run",))
            self._steps = Counter("rayppo_steps", description="PPO iterations completed.", tag_keys=("run",))
            self._step_time = Histogram(
                "rayppo_step_seconds",
                description="Wall seconds per PPO iteration.",
                boundaries=STEP_SECONDS_BOUNDARIES,
                tag_keys=("run",),
            )
            self.enabled = True
        except Exception as err:  # metrics must never stop a run
            logger.warning("telemetry off: Ray metrics unavailable (%s)", err)

    def record_step(
        self,
        metrics: dict[str, float],
        extra: dict[str, float] | None = None,
        worker_lags: dict[str, int] | None = None,
    ) -> None:
        """Export one iteration's metrics (the controller's keys; missing ones are skipped).

        `extra` holds values outside the controller's metric set; each becomes a gauge named
        `rayppo_<key>` (non-alphanumerics as `_`) on first use.
        """
        if not self.enabled:
            return
        try:
            self._record(metrics, extra or {})
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

    def _record(self, metrics: dict[str, float], extra: dict[str, float]) -> None:
        tags = self._tags
        for key, gauge in self._gauges.items():
            value = _finite(metrics.get(key))
            if value is not None:
                gauge.set(value, tags=tags)
        for key, role in ROLE_BUSY.items():
            value = _finite(metrics.get(key))
            if value is not None:
                self._busy.set(value, tags={**tags, "role": role})
        for key, counter in self._counters.items():
            value = _finite(metrics.get(key))
            if value is not None and value > 0:
                counter.inc(value, tags=tags)
        step_s = _finite(metrics.get("time/step"))
        if step_s is not None and step_s >= 0:
            self._step_time.observe(step_s, tags=tags)
        self._steps.inc(1.0, tags=tags)
        for key, raw in extra.items():
            value = _finite(raw)
            if value is None:
                continue
            gauge = self._extra.get(key)
            if gauge is None:
                gauge = self._Gauge(metric_name(key), description=f"Run value '{key}'.", tag_keys=("run",))
                self._extra[key] = gauge
            gauge.set(value, tags=tags)


def _finite(value: Any) -> float | None:
    """Non-finite values are skipped: Ray drops NaN gauge points, and a NaN would hide the last good one."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
