"""Multi-turn episodes through the whole pipeline on a real local Ray (the demo's models; the sync runs
in the demo's colocated placement, the async ones separate): sync and async mode, episodes whose
environment fails dropped and counted (never scored), the failure bound, and exactly-once over a
resume mid-stream in async mode."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from demo_run import CONFIG, demo_overrides, prompt_file

from cluster.config.schema import load_config
from cluster.pipeline.checkpoint import latest_checkpoint
from cluster.pipeline.failures import EnvironmentFailureError
from cluster.pipeline.run import Run

pytestmark = pytest.mark.slow
ENV_MODULE = Path(__file__).resolve().parent / "multiturn_envs.py"  # shipped to the workers as a file


def env_cfg(assets, folder, steps, n_prompts=32, **extra):
    sets = {
        "data.prompts_path": prompt_file(assets, folder, n_prompts),
        "data.prompts_per_step": 8,
        "rollout.chunk_size": 4,
        "rollout.num_cpus_per_worker": 0.25,
        "rollout.sampling.max_new_tokens": 8,
        "rollout.environment.name": "test-review",
        "rollout.environment.module": ENV_MODULE,
        "rollout.environment.max_turns": 3,
        "rollout.environment.max_total_tokens": 48,
        "rollout.environment.max_failure_frac": 0.6,
        "reward.kind": "environment",
        "learner.micro_batch_size": 8,
        **extra,
    }
    return load_config(CONFIG, demo_overrides(assets, steps, **sets))


def test_sync_trains_on_episodes_and_drops_failed_ones(ray_local, demo_assets, tmp_path):
    extra = {"rollout.environment.kwargs": "{fail_every: 4}", "cluster.placement": "colocated"}
    cfg = env_cfg(demo_assets, tmp_path, 3, **extra)
    trainer = Run(cfg, tmp_path / "run")
    try:
        rows = [trainer.iteration() for _ in range(3)]
    finally:
        trainer.close()
    failed = sum(r["env/failures"] for r in rows)
    assert 0 < failed < 24
    for r in rows:
        assert r["env/episodes"] == 8 and r["env/turns"] >= 1.5
        assert r["env/observation_tokens"] > 0 and r["env/tool_calls_rate"] > 0
        assert r["rollout/samples"] == 8 - r["env/failures"]  # dropped, not scored 0
        assert r["rollout/reward_failures"] == r["env/failures"]
        for key in ("loss/policy", "loss/value", "objective/kl", "rollout/reward_mean"):
            assert math.isfinite(r[key]), key


def test_too_many_environment_failures_stop_the_run(ray_local, demo_assets, tmp_path):
    sets = {
        "rollout.environment.kwargs": "{fail_every: 1}",
        "rollout.environment.max_failure_frac": 0.2,
        "cluster.placement": "colocated",  # the bound is the driver's rule, whatever the placement
    }
    trainer = Run(env_cfg(demo_assets, tmp_path, 2, **sets), tmp_path / "run")
    try:
        with pytest.raises(EnvironmentFailureError, match="rollout.environment.max_failure_frac"):
            trainer.iteration()
    finally:
        trainer.close()


def test_async_episodes_resume_mid_stream_exactly_once(ray_local, demo_assets, tmp_path):
    extra = {
        "pipeline.mode": "async",
        "pipeline.max_staleness": 1,
        "learner.off_policy": "tis",
        "checkpoint.every_steps": 2,
        "rollout.environment.kwargs": "{fail_every: 5}",
    }
    trainer = Run(env_cfg(demo_assets, tmp_path, 4, **extra), tmp_path / "run")
    try:
        first = [trainer.iteration() for _ in range(3)]
    finally:
        trainer.close()
    assert all(r["env/episodes"] >= 8 for r in first)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step-000002"
    assert json.loads((ckpt / "state.json").read_text())["outstanding"]
    resumed = Run(env_cfg(demo_assets, tmp_path, 4, **extra), tmp_path / "run", resume_from=ckpt)
    try:
        assert resumed.step == 2
        for _ in range(2):
            resumed.iteration()
    finally:
        resumed.close()
    # one epoch of 32 prompts in 4 steps of 8: each trained once, or skipped once (its episode failed)
    progress = resumed.progress
    assert progress.skipped_prompts and not set(progress.skipped_prompts) & set(progress.trained_prompts)
    counts = progress.trained_prompts + progress.skipped_prompts
    assert set(counts.values()) == {1} and set(counts) == {p.index for p in resumed.prompts}


def test_environment_actors_restart_a_hung_sandbox_and_the_run_goes_on(ray_local, demo_assets, tmp_path):
    sets = {
        "rollout.environment.placement": "actors",
        "rollout.environment.num_replicas": 2,
        "rollout.environment.timeout_s": 3,
        "rollout.environment.kwargs": "{hang_every: 8}",
        "rollout.environment.max_failure_frac": 0.95,  # a killed actor fails the episodes it held too
    }
    trainer = Run(env_cfg(demo_assets, tmp_path, 2, **sets), tmp_path / "run")
    try:
        hosts = trainer.roles.environments
        assert len(hosts) == 2
        rows = [trainer.iteration() for _ in range(2)]
        assert ray_local.get([h.ping.remote() for h in hosts], timeout=60) == [True, True]  # restarted, alive
    finally:
        trainer.close()
    assert sum(r["env/status/env_timeout"] for r in rows) > 0  # the hung episodes, never scored
    assert sum(r["env/status/done"] for r in rows) > 0 and all(r["rollout/samples"] > 0 for r in rows)
