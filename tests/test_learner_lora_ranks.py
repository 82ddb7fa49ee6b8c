"""LoRA end to end on real DeepSpeed ranks (Ray actors, gloo) and a real hf engine, in one run:

2 ZeRO-3 ranks take a PPO step: the base weights stay bit-identical, only adapters (and the critic's
value head) are in the checkpoint with Adam state; the merged export changes exactly the adapted
weights; an hf engine loading it computes the learner's probe logprobs and the acknowledgement
passes, while the base-only bundle (what a dropped adapter looks like) is refused; the adapter-only
export (rollout.lora_sync='adapter') is the merged export's difference to the base, and an engine
applying it computes what the merged one computes. The checkpoint
resumes on 1 ZeRO-2 rank to the same next step, and replays bit-exactly on the 2 ZeRO-3 ranks.
`final/` is the merged HF model with the PEFT adapter in `final/adapter/`.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from test_learner_ranks import _assert_same_weights, _call, _config, _train, _trajectories, learner_group
from transformers import AutoModelForCausalLM

from learner.config import LoRAConfig
from learner.consolidated_checkpoint import INDEX
from learner.gather import cpu_state_dict
from learner.lora import merge_weight
from learner.rank import LearnerRank

pytestmark = pytest.mark.slow

ADAPTED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class InspectedRank(LearnerRank):
    """A LearnerRank that also reports its frozen policy weights (gathered) and its optimizer's size."""

    def frozen_weights(self) -> dict[str, torch.Tensor] | None:
        params = {n: p for n, p in self.engine.module.policy.named_parameters() if not p.requires_grad}
        return cpu_state_dict(params, self._bucket_bytes, keep=self.rank == 0)

    def export_adapter(self, describe, dtype: str):
        """`export_weights` as a run with rollout.lora_sync='adapter' makes it (learner.export_adapter)."""
        self.config.export_adapter = True
        try:
            return self.export_weights(describe, dtype)
        finally:
            self.config.export_adapter = False

    def optimizer_numel(self) -> int:
        """Elements of this rank's fp32 partitions, the tensors Adam keeps state for."""
        from learner.consolidated_checkpoint import _flat_partitions

        return sum(t.numel() for t in _flat_partitions(self.engine))


def _export(ray, ranks, method: str = "export_weights"):
    from cluster.weights.push import bundle_facts

    bundles = _call(ray, ranks, method, *[(bundle_facts("float32"), "float32")] * len(ranks))
    return bundles[0], ray.get(ranks[0].export_fingerprint.remote())


def test_lora_ppo_step_engine_ack_checkpoint_and_final(ray_local, tiny_policy_dir, tmp_path):
    from peft import PeftModel

    from cluster.weights.push import WeightSyncError, expected_fingerprint, verify_ack
    from rollout_workers.config import RolloutConfig
    from rollout_workers.worker import RolloutWorker

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable on workers
    lora = LoRAConfig(rank=4, alpha=8.0)
    z3 = _config(
        zero_stage=3,
        lora=lora,
        deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        export_bucket_mb=0.001,  # many buckets: adapters gathered with their base weights, bucket by bucket
    )
    z2 = _config(zero_stage=2, lora=lora)
    batch1, batch2 = _trajectories(8, seed=7), _trajectories(6, seed=8)
    shards1, shards2 = [batch1[:4], batch1[4:]], [batch2[:2], batch2[2:]]
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).state_dict()
    with (
        learner_group(ray, 2, tiny_policy_dir, z3, rank_cls=InspectedRank) as two,
        learner_group(ray, 1, tiny_policy_dir, z2, rank_cls=InspectedRank) as one,
    ):
        v0, _ = _export(ray, two)  # B starts at zero: the merged model is the base model
        _assert_same_weights(v0, base, atol=0)
        frozen = _call(ray, two, "frozen_weights")[0]
        _train(ray, two, shards1)
        _assert_same_weights(_call(ray, two, "frozen_weights")[0], frozen, atol=0)  # base bit-identical
        v1, meta1 = _export(ray, two)
        changed = sorted(k for k in v1 if not torch.equal(v1[k], v0[k]))
        assert changed == sorted(k for k in base if k.endswith(ADAPTED))

        # A real hf engine loads the merged bundle and computes the learner's (unmerged) probe logprobs;
        # the base-only bundle (an adapter that never arrived) is refused by its digest.
        worker = RolloutWorker(str(tiny_policy_dir), RolloutConfig(engine="hf"))
        merged_ack = worker.load_weights(v1, 1)
        verify_ack("hf", merged_ack, 1, expected_fingerprint(meta1, 1, "float32"))
        with pytest.raises(WeightSyncError, match="digest differs"):
            verify_ack("hf", worker.load_weights(v0, 2), 2, expected_fingerprint(meta1, 2, "float32"))

        # rollout.lora_sync='adapter': the ZeRO-3 ranks export the adapter alone (B scaled by alpha/r),
        # which is the merged export's difference to the base, and an hf engine applying it computes
        # what the merged engine computes
        a1, meta_a1 = _export(ray, two, "export_adapter")
        assert sum(t.numel() for t in a1.values()) < 0.2 * sum(t.numel() for t in v1.values())
        for key in changed:
            module = key.removesuffix(".weight")
            by_hand = merge_weight(base[key], a1[f"{module}.lora_A"], a1[f"{module}.lora_B"], 1.0, True)
            torch.testing.assert_close(by_hand, v1[key], atol=1e-6, rtol=0)
        adapter_worker = RolloutWorker(str(tiny_policy_dir), RolloutConfig(engine="hf", lora_sync="adapter"))
        adapter_ack = adapter_worker.load_weights(a1, 1)
        verify_ack("hf", adapter_ack, 1, expected_fingerprint(meta_a1, 1, "float32"))
        for got, want in zip(adapter_ack.probe, merged_ack.probe, strict=True):
            assert abs(got - want).max() < 1e-5

        # The checkpoint holds the adapters and the value head only, each with its Adam moments.
        ckpt = tmp_path / "ckpt"
        _call(ray, two, "save_checkpoint", *[(str(ckpt), {"data_position": 8})] * 2)
        index = json.loads((ckpt / INDEX).read_text())
        names = set(index["params"])
        assert all(
            ".lora_A.default." in n or ".lora_B.default." in n
            for n in names - {"value_head.weight", "value_head.bias"}
        )
        assert "value_head.weight" in names and index["optimizer_keys"] == ["exp_avg", "exp_avg_sq"]
        trainable = sum(torch.Size(e["shape"]).numel() for e in index["params"].values())
        assert trainable < 0.2 * sum(t.numel() for t in base.values())
        assert (
            trainable <= sum(_call(ray, two, "optimizer_numel")) < trainable + 64
        )  # Adam state: trainable only

        # Resume on 1 ZeRO-2 rank: the same next step; and the 2 ZeRO-3 ranks replay it bit-exactly.
        m2 = _train(ray, two, shards2)
        w2, _ = _export(ray, two)
        _call(ray, one, "load_checkpoint", (str(ckpt),))
        m1 = _train(ray, one, [batch2])
        _assert_same_weights(_export(ray, one)[0], w2)
        assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], rel=1e-5, abs=1e-7)
        _call(ray, two, "load_checkpoint", *[(str(ckpt),)] * 2)
        replay = _train(ray, two, shards2)
        assert {k: v for k, v in replay.items() if k != "train/compute_s"} == {
            k: v for k, v in m2.items() if k != "train/compute_s"
        }
        _assert_same_weights(_export(ray, two)[0], w2, atol=0)

        # final/: the merged model as a plain HF folder, the adapter in PEFT's format beside it.
        final = tmp_path / "final"
        _call(ray, two, "save_pretrained", *[(str(final),)] * 2)
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    _assert_same_weights(merged.state_dict(), w2, atol=0)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32), str(final / "adapter")
    ).eval()
    ids = torch.tensor([[5, 9, 11, 7, 20, 4]])
    with torch.no_grad():
        torch.testing.assert_close(
            adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def test_the_reference_from_the_base_weights_equals_a_separate_reference(ray_local, tiny_policy_dir):
    """learner.reference_from_base (reference.source='policy_base'): trajectories carry no reference
    logprobs and the learner computes them from its base weights with the LoRA adapters off. Two ZeRO-3
    ranks doing so take the same steps as one ZeRO-2 rank handed a separate reference's logprobs
    (`ReferencePolicy` on the initial model, as the reference actors compute them): at step 1, where
    the adapters' B is still 0, and at step 2, after they moved, where the KL to the reference is > 0."""
    import dataclasses

    from reward_service.config import ReferenceConfig
    from reward_service.reference import ReferencePolicy

    ray = ray_local
    lora = LoRAConfig(rank=4, alpha=8.0)
    lr = 3e-2  # adapters that move: the second step's KL to the base is well above float noise
    z3 = _config(
        zero_stage=3,
        lora=lora,
        lr=lr,
        reference_from_base=True,
        deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    z2 = _config(zero_stage=2, lora=lora, lr=lr)
    reference = ReferencePolicy(str(tiny_policy_dir), ReferenceConfig(), temperature=0.8)

    def with_reference(batch):
        lps = reference.logprobs([t.prompt_ids for t in batch], [t.response_ids for t in batch])
        return [dataclasses.replace(t, ref_logprobs=lp) for t, lp in zip(batch, lps, strict=True)]

    def without_reference(batch):
        return [dataclasses.replace(t, ref_logprobs=None) for t in batch]

    with learner_group(ray, 2, tiny_policy_dir, z3) as two, learner_group(ray, 1, tiny_policy_dir, z2) as one:
        for step, seed in enumerate((11, 12), start=1):
            batch = _trajectories(8, seed=seed)
            m2 = _train(ray, two, [without_reference(batch[:4]), without_reference(batch[4:])])
            m1 = _train(ray, one, [with_reference(batch)])
            for key in ("objective/kl", "returns/mean", "loss/policy", "loss/value"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), (step, key)
            if step == 2:
                assert m1["objective/kl"] > 1e-3  # the adapters moved the policy off its base
        _assert_same_weights(_export(ray, two)[0], _export(ray, one)[0], atol=2e-5)
