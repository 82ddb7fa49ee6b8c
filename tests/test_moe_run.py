"""Routing replay through a whole run on a real local Ray (issue 61): a tiny Qwen3-MoE policy (built on the
spot) on the demo's prompts and reward, the hf engine in bf16 recording the routing
(`rollout.record_routing`), the float32 learner under `learner.router_replay` none and R3. The routing
goes sample -> object store -> learner rank (never through the driver), and the step-1 proximal pass,
on the same samples in both runs (same seed, same initial weights), is closer to the engine's logprobs
under R3."""

from __future__ import annotations

import math

import pytest
from demo_run import CONFIG, SMALL_STEPS, demo_overrides, train_rows
from tiny_models import build_causal_lm

from cluster.config.schema import load_config

pytestmark = pytest.mark.slow


def test_a_run_records_the_routing_and_the_learner_replays_it(ray_local, demo_assets, tmp_path):
    # initializer_range 0.02 (a trained model's scale): bf16 stays within the weight push's probe tolerance
    policy = build_causal_lm(tmp_path / "moe", "qwen3_moe", seed=2, initializer_range=0.02)
    rows = {}
    for mode in ("none", "R3"):
        sets = {
            **SMALL_STEPS,
            "model.policy_path": policy,
            "rollout.dtype": "bfloat16",
            "rollout.record_routing": True,
            "learner.router_replay": mode,
        }
        cfg = load_config(CONFIG, demo_overrides(demo_assets, 1, **sets))
        rows[mode] = train_rows(cfg, tmp_path / mode, 1)[0]
    for mode, row in rows.items():
        assert all(math.isfinite(row[k]) for k in ("loss/policy", "params/grad_norm")), (mode, row)
    # the same samples in both runs (the reward of the same texts), a smaller gap under replay
    assert rows["R3"]["rollout/reward_mean"] == rows["none"]["rollout/reward_mean"]
    gap = {mode: row["rollout/logprob_gap"] for mode, row in rows.items()}
    print(f"step-1 mean |learner - engine logprob|: {gap}")
    assert 0 < gap["R3"] < gap["none"]
