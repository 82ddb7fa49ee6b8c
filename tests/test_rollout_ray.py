"""RolloutWorker as a real Ray actor: arguments and results cross process boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.weights import state_checksum
from rollout_workers.worker import RolloutWorker

TIMEOUT_S = 120


@pytest.mark.slow
def test_rollout_worker_as_ray_actor(ray_local, tiny_policy_dir, tmp_path):
    from tiny_models import build_policy

    ray = ray_local
    config = RolloutConfig(sampling=SamplingConfig(n=2, max_new_tokens=10))
    actor = ray.remote(RolloutWorker).options(num_cpus=0.5).remote(str(tiny_policy_dir), config, 3, 4)
    assert "rollout worker 3 (hf)" in ray.get(actor.ping.remote(), timeout=TIMEOUT_S)

    prompts = [np.array([1, 4, 5]), np.array([1, 7, 8, 9, 10])]
    samples = ray.get(actor.generate.remote([0, 1], prompts, 11), timeout=TIMEOUT_S)
    assert [(s.prompt_index, s.sample_index, s.policy_version) for s in samples] == [
        (0, 0, 4), (0, 1, 4), (1, 0, 4), (1, 1, 4)
    ]  # fmt: skip
    local = RolloutWorker(str(tiny_policy_dir), config).generate([0, 1], prompts, 11)
    assert [s.response_ids.tolist() for s in samples] == [s.response_ids.tolist() for s in local]

    bundle = AutoModelForCausalLM.from_pretrained(build_policy(tmp_path / "v5", seed=2)).state_dict()
    bundle_ref = ray.put(bundle)  # loaded once into the object store, as the driver does
    ack = ray.get(actor.load_weights.remote(bundle_ref, 5), timeout=TIMEOUT_S)
    assert (ack.version, ack.checksum) == (5, state_checksum(bundle, torch.float32))
    assert [len(p) for p in ack.probe] == [7, 8, 9, 10]  # logprobs of tokens 1.. of the fixed probe
    assert ray.get(actor.version.remote(), timeout=TIMEOUT_S) == 5
    after = ray.get(actor.generate.remote([0, 1], prompts, 11), timeout=TIMEOUT_S)
    assert {s.policy_version for s in after} == {5}
    assert [s.response_ids.tolist() for s in after] != [s.response_ids.tolist() for s in samples]
    stats = ray.get(actor.stats.remote(), timeout=TIMEOUT_S)
    assert stats["samples"] == 8 and stats["weight_loads"] == 1 and stats["policy_version"] == 5
    ray.kill(actor)
