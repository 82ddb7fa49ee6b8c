"""Rollout worker placement and run-derived engine settings (no Ray cluster needed)."""

from __future__ import annotations

from cluster.config.schema import build_config
from cluster.placement.plan import PlacementPlan
from cluster.placement.rollout_gpus import RolloutPlacement, worker_config


def _cfg(**rollout):
    return build_config(
        {
            "model": {"policy_path": "p"},
            "data": {"prompts_path": "x.jsonl", "max_prompt_tokens": 20},
            "reward": {"kind": "rule", "rule": "exact_match"},
            "rollout": rollout,
        }
    )


def test_vllm_reserves_kv_cache_for_the_longest_prompt_and_response_only():
    cfg = _cfg(engine="vllm", sampling={"max_new_tokens": 12})
    assert worker_config(cfg).vllm.max_model_len == 32 and cfg.rollout.vllm.max_model_len is None
    assert worker_config(_cfg(engine="vllm", vllm={"max_model_len": 100})).vllm.max_model_len == 100
    assert worker_config(_cfg(engine="hf")).vllm.max_model_len is None


def test_single_device_workers_are_bundles_of_the_plan_tensor_parallel_ones_a_group():
    pinned = {"rollout_node": 1.0}
    plan = PlacementPlan(_cfg(engine="vllm", num_cpus_per_worker=1, num_gpus_per_worker=1, resources=pinned))
    # learner rank first, then the worker, the reference and the scorer: one group, one bundle each
    assert plan.bundles == [{"CPU": 0.5}, {"CPU": 1, "GPU": 1, **pinned}, {"CPU": 0.25}, {"CPU": 0.25}]
    assert plan.options("rollout", 0) == {"num_cpus": 1, "num_gpus": 1, "resources": pinned}
    assert not plan.rollout.groups and not plan.own_groups()
    cpu_tp = RolloutPlacement(_cfg(engine="vllm", num_gpus_per_worker=0, vllm={"tensor_parallel_size": 2}))
    assert not cpu_tp.tensor_parallel_on_gpus  # vLLM's mp executor forks inside the actor
    gpu_tp = PlacementPlan(
        _cfg(engine="vllm", num_gpus_per_worker=2, vllm={"tensor_parallel_size": 2}, resources=pinned)
    )
    assert gpu_tp.rollout.tensor_parallel_on_gpus  # a 0-GPU wrapper in a 2-GPU group (needs GPUs to run)
    assert gpu_tp.bundles == [{"CPU": 0.5}, {"CPU": 0.25}, {"CPU": 0.25}]  # the worker is not in the gang
    assert gpu_tp.own_groups() == [[{"GPU": 1.0, "CPU": 0.5, **pinned}, {"GPU": 1.0}]]
