"""The metrics the driver writes into a step's row (both pipelines, the evaluator, dynamic sampling,
the run), declared once. The learner's are `learner.metric_names`; no name is both
(tests/test_metric_names.py). Their meanings: docs/metrics.md."""

from __future__ import annotations

from kernel.metric_names import MetricNames

DRIVER_METRICS = MetricNames(
    "driver",
    frozenset(
        {
            # the step's samples (`metrics.sample_metrics`), both pipelines
            "rollout/reward_mean",
            "rollout/reward_std",
            "rollout/reward_prob_mean",
            "rollout/response_length",
            "rollout/truncated_frac",
            "rollout/samples",
            "rollout/reward_failures",
            "rollout/flat_groups_frac",
            "rollout/staleness_mean",
            "throughput/tokens_per_s",
            "throughput/samples_per_s",
            "data/empty_prompts",
            "data/truncated_prompts",
            "data/skipped_prompts",
            # the step (`metrics.step_metrics`), both pipelines
            "time/generate",
            "time/score",
            "time/train",
            "time/weight_sync",
            "time/step",
            "policy_version",
            "scale/rollout_workers",
            "scale/events",
            "faults/actor_replacements",
            "faults/redispatched_chunks",
            "faults/lost_chunks",
            # the step's queue: sync, the most chunks waiting for scores at once; async, the scored
            # prompts buffered when the step began (one gauge, rayppo_trajectory_queue_depth)
            "rollout/queue_depth",
            # async only
            "time/wait_data",
            "staleness/max",
            "staleness/dropped_samples",
            "staleness/requeued_prompts",
            "staleness/versions_per_response",
            "staleness/interrupted_frac",
            "staleness/interrupted_segments",
            "staleness/token_lag_mean",
            "pipeline/generator_idle_frac",
            "pipeline/learner_idle_frac",
            "weights/version_lag_mean",
            "weights/version_lag_max",
            # dynamic sampling
            "dynamic/filtered_groups",
            "dynamic/extra_prompts",
            "dynamic/rounds",
            "dynamic/shortfall_groups",
            "dynamic/filtered_total",
            # held-out evaluation
            "time/eval",
        }
    ),
    families=(
        "staleness/hist_",  # staleness/hist_<k>, k = 0 ... max_staleness
        "reward/",  # reward/<function>
        "reward_failures/",  # reward_failures/<function>
        "env/",  # episodes: env/turns, env/status/<status>, env/<counter>, env/<counter>_rate
        "eval/",  # held-out: eval/reward_mean, eval/pass@k, eval/env/..., eval/reward/<function>
        "weights/learner_",  # where the weight pushes spent their time (`WeightPublisher.take_stages`)
        "weights/worker_",
    ),
)
