"""The demo on vLLM end to end (`make test-vllm`): a real local Ray, a vLLM rollout worker (vLLM's
CPU build here, in-process engine core), reference, reward scorer and a DeepSpeed learner.

Both weight paths (object store, collective broadcast). Checked: every step's weights are
acknowledged by the worker's probe logprobs (the push raises otherwise) and versions advance; the
worker computes what the learner's final weights compute; behaviour logprobs agree with the
learner's (float32 on both sides); the reward goes up.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import ray
from demo_run import CONFIG, demo_overrides

from cluster.config import load_config
from cluster.controller import Trainer
from cluster.weight_sync import expected_fingerprint, verify_ack

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not importable here (make test-vllm installs it)",
    ),
]


@pytest.mark.parametrize(
    ("weight_sync", "placement"),
    [("object_store", "separate"), ("collective", "separate"), ("object_store", "colocated")],
)
def test_demo_trains_with_the_vllm_engine(ray_local, demo_assets, tmp_path, weight_sync, placement):
    """Colocated: the in-process vLLM engine shares the learner rank's process (a hybrid engine)."""
    steps = 6
    sets = {"rollout.engine": "vllm", "rollout.weight_sync": weight_sync, "cluster.placement": placement}
    cfg = load_config(CONFIG, demo_overrides(demo_assets, steps, **sets))
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.setup()
        workers, names = trainer.roles.workers.handles, trainer.roles.workers.names
        if placement == "separate":
            assert all("(vllm)" in p for p in ray.get([w.ping.remote() for w in workers], timeout=60))
        else:
            assert (
                len(trainer.roles.hosts) == 1
                and trainer.roles.workers.handles[0].host == trainer.roles.hosts[0]
            )
        for step in range(1, steps + 1):
            m = trainer.iteration()
            assert ray.get([w.version.remote() for w in workers], timeout=60) == [step] * len(workers)
            assert m["policy_version"] == step and math.isfinite(m["rollout/reward_mean"])
            # Same float32 weights: the generator's behaviour logprobs are the learner's old logprobs.
            assert m["rollout/logprob_gap"] < 1e-3, m["rollout/logprob_gap"]
        # Independently of the acks in push_weights: the worker computes what the learner's weights compute.
        ranks = trainer.roles.ranks
        ray.get([r.export_weights.remote() for r in ranks], timeout=120)
        expected = expected_fingerprint(ray.get(ranks[0].export_fingerprint.remote()), steps, "float32")
        for name, ack in zip(
            names, ray.get([w.fingerprint.remote() for w in workers], timeout=60), strict=True
        ):
            assert ack.checksum is None  # vLLM cannot read its weights back: the probe is the proof
            verify_ack(name, ack, steps, expected)
    finally:
        trainer.close()
    rewards = [h["rollout/reward_mean"] for h in trainer.history]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 1.0, rewards
    assert trainer.history[-1]["objective/kl"] > 0
