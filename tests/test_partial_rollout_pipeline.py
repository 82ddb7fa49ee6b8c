"""Partial rollouts end to end (`pipeline.partial_rollout`), async mode on a real local Ray with the real
demo models: new weights reach workers inside their chunks (object store and collective), every
trained sample stays within the staleness bound by its oldest token, every prompt is trained exactly
once, and with `stale_policy: wait` nothing is ever dropped.

The workload makes chunks long next to a learner step, whatever the machine's speed: 3-turn episodes
whose environment answers each turn after 0.75 s (a slow tool), so a chunk takes >= 2.25 s, several
times a learner step of the tiny demo, and the learner publishes while the workers are inside their
chunks; the weights come in between turns or inside a turn's generation. (The engines' own interruption points are tested exactly, with a load
made at a chosen token, in tests/test_partial_rollout_engines.py.)"""

from __future__ import annotations

import pytest
from demo_run import CONFIG, demo_overrides, prompt_file
from extras import needs
from test_multiturn_pipeline import ENV_MODULE

from cluster.config.schema import load_config
from cluster.pipeline.run import Run

pytestmark = pytest.mark.slow

STEPS, P, ETA = 4, 8, 1


def _run(assets, tmp_path, **extra):
    sets = {
        "pipeline.mode": "async",
        "pipeline.max_staleness": ETA,
        "pipeline.partial_rollout": True,
        "learner.off_policy": "tis",
        "data.prompts_per_step": P,
        "data.prompts_path": prompt_file(assets, tmp_path, STEPS * P),
        "rollout.num_workers": 2,
        "rollout.num_cpus_per_worker": 0.25,
        "rollout.chunk_size": 4,
        "learner.micro_batch_size": 8,
        "rollout.environment.name": "test-review",
        "rollout.environment.module": ENV_MODULE,
        "rollout.environment.max_turns": 3,
        "rollout.environment.max_total_tokens": 48,
        "rollout.environment.kwargs": "{turns: 3, delay: 0.75}",
        "reward.kind": "environment",
        **extra,
    }
    trainer = Run(load_config(CONFIG, demo_overrides(assets, STEPS, **sets)), tmp_path / "run")
    try:
        rows = [trainer.iteration() for _ in range(STEPS)]
    finally:
        trainer.close()
    return trainer, rows


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="object_store"),
        pytest.param({"rollout.weight_sync": "collective"}, id="collective"),
        pytest.param({"pipeline.stale_policy": "wait"}, id="wait"),
        pytest.param(
            {"rollout.engine": "vllm", "rollout.weight_sync": "collective"},
            id="vllm-collective",
            marks=needs("vllm"),
        ),
    ],
)
def test_weights_reach_workers_inside_their_chunks(ray_local, demo_assets, tmp_path, extra):
    trainer, rows = _run(demo_assets, tmp_path, **extra)
    for m in rows:
        assert m["staleness/max"] <= ETA  # the oldest token of every trained sample
        assert 1.0 <= m["staleness/versions_per_response"] <= 1.0 + ETA + 1
        assert (
            m["staleness/token_lag_mean"] <= m["rollout/staleness_mean"] + 1e-9
        )  # no token older than its sample
        if extra.get("pipeline.stale_policy") == "wait":
            assert m["staleness/dropped_samples"] == 0
    # weights did cut into generations: some trained responses span two versions
    assert sum(m["staleness/interrupted_segments"] for m in rows) > 0, [
        m["staleness/interrupted_segments"] for m in rows
    ]
    # one epoch of 4 x 8 prompts, each trained exactly once
    assert set(trainer.progress.trained_prompts.values()) == {1}
    assert set(trainer.progress.trained_prompts) == {p.index for p in trainer.prompts}
