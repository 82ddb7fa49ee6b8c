"""`rollout.lora_sync: adapter` in process: the learner's adapter bundle (`learner.lora.adapter_bundle`)
applied by a real hf engine (`rollout_workers.adapter`, PEFT layers) computes what the merged weights
compute, and the acknowledgement refuses an engine that dropped the adapter, kept an older one, or
holds it without applying it. Bad bundles are refused naming the keys and change nothing. The real
DeepSpeed ranks (a PPO step, ZeRO-3 gathers) are in test_learner_lora_ranks."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from test_learner_lora import LORA, _trained

from cluster.weights.push import WeightSyncError, describe_bundle, expected_fingerprint, verify_ack
from kernel.sequences import probe_sequences, right_padded
from learner.config import LoRAConfig
from learner.lora import adapter_bundle, merged_cpu_state_dict
from rollout_workers.config import RolloutConfig
from rollout_workers.weights import state_checksum
from rollout_workers.worker import RolloutWorker

BIG = 1 << 30
ADAPTER = RolloutConfig(engine="hf", lora_sync="adapter")


def _probe(model) -> list:
    """The learner-side probe logprobs of `model` (a PolicyWithValueHead's HF policy), float32."""
    seqs = probe_sequences(int(model.get_output_embeddings().weight.shape[0]))
    ids, mask = right_padded(seqs, torch.device("cpu"))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [row[: int(n) - 1].numpy() for row, n in zip(logp, mask.sum(-1), strict=True)]


def _meta(policy, bundle) -> dict:
    """What learner rank 0 records for a push of `bundle` (rank.export_weights), at float32."""
    return {"probe": _probe(policy), "dtype": "float32", **describe_bundle(bundle, "float32", BIG)}


def _two_adapters(path, cfg: LoRAConfig = LORA):
    """The first of two LoRA policies of the model at `path` (the second's adapters are the first's times
    -1.5), both adapter bundles and what learner rank 0 records for a push of each (`_meta`)."""
    first, second = _trained(path, cfg).policy, _trained(path, cfg).policy
    with torch.no_grad():
        for p in second.parameters():
            if p.requires_grad:
                p.mul_(-1.5)
    b1, b2 = (adapter_bundle(m, BIG, keep=True) for m in (first, second))
    return first, b1, b2, _meta(first, b1), _meta(second, b2)


def test_an_adapter_computes_what_the_merged_weights_compute(tiny_policy_dir):
    """The bundle is lora_A / lora_B (alpha/r folded into B) under the base model's module names, a few
    percent of the full weights; an engine that applies it and one that loads the merged weights give
    the learner's probe logprobs (float32), and the ack's digest and checksum are those of the bundle."""
    policy = _trained(tiny_policy_dir).policy
    bundle = adapter_bundle(policy, BIG, keep=True)
    merged = merged_cpu_state_dict(policy, BIG, keep=True)
    assert bundle and all(k.endswith((".lora_A", ".lora_B")) for k in bundle)
    assert {k.rpartition(".")[0] for k in bundle} == {
        k.removesuffix(".weight")
        for k in merged
        if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
    }
    size = sum(t.numel() for t in bundle.values())
    assert size < 0.2 * sum(t.numel() for t in merged.values())
    layer = policy.get_submodule("transformer.h.0.attn.c_attn")
    torch.testing.assert_close(
        bundle["transformer.h.0.attn.c_attn.lora_B"], layer.lora_B["default"].weight * LORA.alpha / LORA.rank
    )

    meta_a, meta_m = _meta(policy, bundle), _meta(policy, merged)
    with_adapter = RolloutWorker(str(tiny_policy_dir), ADAPTER)
    ack_a = with_adapter.load_weights(bundle, 1)
    verify_ack("adapter", ack_a, 1, expected_fingerprint(meta_a, 1, "float32"))
    assert ack_a.held == ack_a.received == meta_a["digest"]
    assert ack_a.checksum == state_checksum(bundle, torch.float32) == with_adapter.checksum()
    ack_m = RolloutWorker(str(tiny_policy_dir), RolloutConfig(engine="hf")).load_weights(merged, 1)
    verify_ack("merged", ack_m, 1, expected_fingerprint(meta_m, 1, "float32"))
    for a, m in zip(ack_a.probe, ack_m.probe, strict=True):
        assert abs(a - m).max() < 1e-5
    assert max(abs(a - b).max() for a, b in zip(ack_a.probe, _probe(policy), strict=True)) < 1e-5


def test_a_dropped_stale_or_unapplied_adapter_is_refused(tiny_policy_dir):
    """After one adapter loads, the next (other values) must reach the layers: an engine that ignores
    the load (drops it, or keeps the older adapter) fails on its digest; one that holds it but runs
    with the adapter switched off passes the digest and fails on the probe."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    _, b1, b2, m1, m2 = _two_adapters(tiny_policy_dir)

    worker = RolloutWorker(str(tiny_policy_dir), ADAPTER)
    verify_ack("w", worker.load_weights(b1, 1), 1, expected_fingerprint(m1, 1, "float32"))
    engine = worker._engine
    real = engine._load_adapter
    engine._load_adapter = lambda state: None  # keeps the older adapter
    with pytest.raises(WeightSyncError, match="digest differs"):
        verify_ack("w", worker.load_weights(b2, 2), 2, expected_fingerprint(m2, 2, "float32"))

    fresh = RolloutWorker(str(tiny_policy_dir), ADAPTER)
    fresh._engine._load_adapter = lambda state: None  # the adapter never arrives: the base model samples
    with pytest.raises(WeightSyncError, match="digest differs"):
        verify_ack("fresh", fresh.load_weights(b1, 1), 1, expected_fingerprint(m1, 1, "float32"))

    engine._load_adapter = real
    verify_ack("w", worker.load_weights(b2, 3), 3, expected_fingerprint(m2, 3, "float32"))
    for layer in engine.model.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.enable_adapters(False)  # held, but not applied
    with pytest.raises(WeightSyncError, match="probe logprobs differ"):
        verify_ack("w", worker.load_weights(b2, 4), 4, expected_fingerprint(m2, 4, "float32"))


def test_bad_adapter_bundles_name_their_keys_and_change_nothing(tiny_policy_dir):
    policy = _trained(tiny_policy_dir).policy
    bundle = adapter_bundle(policy, BIG, keep=True)
    worker = RolloutWorker(str(tiny_policy_dir), ADAPTER)
    engine = worker._engine
    with pytest.raises(ValueError, match="holds no '<module>.lora_A'"):
        engine.load_adapter(merged_cpu_state_dict(policy, BIG, keep=True))
    assert not engine._adapter.modules  # nothing injected
    engine.load_adapter(bundle)
    before = engine.probe_logprobs(probe_sequences(engine.vocab_size))
    key = "transformer.h.1.mlp.c_fc"
    cases = {
        "have lora_A or lora_B but not both": {k: v for k, v in bundle.items() if k != f"{key}.lora_B"},
        r"modules the model does not have: \['transformer.h.9.mlp.c_fc'\]": {
            **bundle,
            "transformer.h.9.mlp.c_fc.lora_A": bundle[f"{key}.lora_A"],
            "transformer.h.9.mlp.c_fc.lora_B": bundle[f"{key}.lora_B"],
        },
        "not linear": {
            **bundle,
            "transformer.wte.lora_A": torch.zeros(4, 3),
            "transformer.wte.lora_B": torch.zeros(3, 4),
        },
        "different ranks": {**bundle, f"{key}.lora_A": bundle[f"{key}.lora_A"][:2]},
        rf"{key}.lora_B: \(\d+, 3\) != \(\d+, 4\)": {
            **bundle,
            f"{key}.lora_B": bundle[f"{key}.lora_B"][:, :3],
        },
        "an adapter's shape is fixed for a run": {
            k: v for k, v in bundle.items() if not k.startswith("transformer.h.0.attn.c_attn")
        },
        r"tensors the model does not have: \['nope.weight'\]": {**bundle, "nope.weight": torch.zeros(2)},
    }
    for match, bad in cases.items():
        with pytest.raises(ValueError, match=match):
            engine.load_adapter(bad)
    after = engine.probe_logprobs(probe_sequences(engine.vocab_size))
    assert all((a == b).all() for a, b in zip(before, after, strict=True))


def test_lora_sync_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="needs rollout.weight_sync='object_store'"):
        RolloutConfig(lora_sync="adapter", weight_sync="collective")
    with pytest.raises(ValidationError, match="lora_sync"):
        RolloutConfig(lora_sync="adapters")
    assert LoRAConfig(rank=4).rank == 4


def test_every_engine_that_says_it_applies_adapters_implements_the_hooks():
    """The registry's `adapters` flag (what the config allows with lora_sync='adapter') is the truth."""
    from kernel.registry import resolve
    from rollout_workers.engine import RolloutEngine
    from rollout_workers.engines import ENGINES

    for engine in ENGINES:
        cls = resolve(engine.function)
        assert (cls._load_adapter is not RolloutEngine._load_adapter) == engine.adapters, engine.name
