"""The demo on vLLM end to end (`make test-vllm`): a real local Ray, a vLLM rollout worker (vLLM's
CPU build here, in-process engine core), reference, reward scorer and a DeepSpeed learner.

Both weight paths (object store, collective broadcast). Checked: every step's weights are
acknowledged by the worker's probe logprobs (the push raises otherwise) and versions advance; the
worker computes what the learner's final weights compute; behaviour logprobs agree with the
learner's (float32 on both sides); the reward goes up.
"""

from __future__ import annotations

import math

import pytest
import ray
from demo_run import CONFIG, demo_overrides
from extras import needs

from cluster.config.schema import load_config
from cluster.pipeline.run import Run
from cluster.weights.push import expected_fingerprint, verify_ack

pytestmark = [pytest.mark.slow, *needs("vllm")]


@pytest.mark.parametrize(
    ("weight_sync", "placement"),
    [("object_store", "separate"), ("collective", "separate"), ("object_store", "colocated")],
)
def test_demo_trains_with_the_vllm_engine(ray_local, demo_assets, tmp_path, weight_sync, placement):
    """Colocated: the in-process vLLM engine shares the learner rank's process (a hybrid engine)."""
    steps = 6
    sets = {"rollout.engine": "vllm", "rollout.weight_sync": weight_sync, "cluster.placement": placement}
    cfg = load_config(CONFIG, demo_overrides(demo_assets, steps, **sets))
    trainer = Run(cfg, tmp_path / "run")
    try:
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
    rewards = [h["rollout/reward_mean"] for h in trainer.progress.history]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 1.0, rewards
    assert trainer.progress.history[-1]["objective/kl"] > 0


def test_two_colocated_ranks_train_on_the_whole_batch_beside_vllm(ray_local, demo_assets, tmp_path):
    """Issue 21, item 4: built before the learner's setup, vLLM's in-process worker made a
    torch.distributed world of size 1 in each colocated host and DeepSpeed adopted it: every
    all-reduce a no-op, each rank training on its half alone (train/tokens about half the batch's).

    Three 2-step runs with 2 learner ranks: vLLM colocated (2 workers), vLLM separate, hf colocated.
    Every rank is in a world of 2, and every step trains on the whole batch (train/tokens = samples x
    mean response length). vLLM gives the same samples in both placements (same seeds and chunks),
    and about as many tokens as hf (the bug halved them)."""

    def learner_world(_actor) -> tuple[int, int]:  # runs in a learner rank's process (pickled by value)
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    steps, runs = 2, {}
    for engine, placement in (("vllm", "colocated"), ("vllm", "separate"), ("hf", "colocated")):
        # Separate: one worker draws both chunks (the seeds are per chunk, not per worker), one vLLM
        # start fewer.
        workers = 1 if placement == "separate" else 2
        sets = {"rollout.engine": engine, "cluster.placement": placement}
        sets |= {"learner.num_ranks": 2, "rollout.num_workers": workers}
        cfg = load_config(CONFIG, demo_overrides(demo_assets, steps, **sets))
        trainer = Run(cfg, tmp_path / f"{engine}-{placement}")
        try:
            ranks = trainer.roles.ranks  # a colocated rank's view runs __ray_call__ in its host
            worlds = ray.get([r.__ray_call__.remote(learner_world) for r in ranks], timeout=60)
            runs[engine, placement] = [trainer.iteration() for _ in range(steps)]
        finally:
            trainer.close()
        for step, m in enumerate(runs[engine, placement], start=1):
            samples, length = m["rollout/samples"], m["rollout/response_length"]
            assert m["train/tokens"] == pytest.approx(samples * length, abs=1e-6), (
                engine,
                placement,
                step,
                m["train/tokens"],
                samples * length,
            )
            assert m["train/sequences"] == samples == 64, (engine, placement, step, m["train/sequences"])
        assert worlds == [(0, 2), (1, 2)], (engine, placement, worlds)
    tokens = {key: [m["train/tokens"] for m in rows] for key, rows in runs.items()}
    lengths = {key: [m["rollout/response_length"] for m in rows] for key, rows in runs.items()}
    assert tokens["vllm", "colocated"] == tokens["vllm", "separate"], tokens
    assert lengths["vllm", "colocated"] == lengths["vllm", "separate"], lengths
    for got, hf in zip(tokens["vllm", "colocated"], tokens["hf", "colocated"], strict=True):
        assert 0.75 < got / hf < 1.33, tokens


def test_a_lora_run_reaches_vllm_as_merged_weights(ray_local, demo_assets, tmp_path):
    """`learner.lora` with the vLLM engine (issue 37's merged path): every push of the merged weights is
    acknowledged by vLLM's probe logprobs, the reference is the learner's base weights (no reference
    actor), and the base-only bundle, what a dropped adapter looks like, is refused."""
    from demo_run import SMALL_STEPS

    from cluster.weights.push import WeightSyncError, bundle_facts

    steps = 3
    sets = {"rollout.engine": "vllm", "learner.lora.rank": 4, "learner.lora.alpha": 16, "learner.lr": 3e-3}
    cfg = load_config(CONFIG, demo_overrides(demo_assets, steps, **SMALL_STEPS, **sets))
    assert cfg.resolved.reference_source == "policy_base"
    trainer = Run(cfg, tmp_path / "run")
    try:
        assert sorted(trainer.roles.by_role) == ["reward", "rollout"]
        ranks, workers = trainer.roles.ranks, trainer.roles.workers.handles
        export = [r.export_weights.remote(bundle_facts("float32"), "float32") for r in ranks]
        base = ray.get(export, timeout=120)[0]  # the adapters' B starts at 0: the merged base model
        rows = [trainer.iteration() for _ in range(steps)]
        assert ray.get(workers[0].version.remote(), timeout=60) == steps
        ray.get([r.export_weights.remote(bundle_facts("float32"), "float32") for r in ranks], timeout=120)
        expected = expected_fingerprint(ray.get(ranks[0].export_fingerprint.remote()), steps + 1, "float32")
        ack = ray.get(workers[0].load_weights.remote(base, steps + 1), timeout=300)
        with pytest.raises(WeightSyncError, match="differs"):
            verify_ack("rollout-worker-0", ack, steps + 1, expected)
    finally:
        trainer.close()
    assert [r["policy_version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["rollout/logprob_gap"] < 1e-3 for r in rows)  # vLLM samples with the merged weights
    assert abs(rows[-1]["objective/kl"]) > 1e-6  # the adapters moved the policy off its base
