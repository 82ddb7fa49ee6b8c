"""`rollout.lora_sync: adapter` on vLLM (`make test-vllm`): the learner's adapter bundle handed to vLLM's
own LoRA support (vLLM's CPU build here) on a tiny Qwen2 (head_dim 32, tied embeddings).

The engine's probe logprobs and its sampled tokens' behaviour logprobs (plain and interruptible
generate calls) equal a float32 forward of the merged weights; an engine that keeps the older
adapter is refused as a stale engine by its own adapter digest, and one that applies it again is
accepted; modules trained whole, which vLLM's LoRA cannot apply, are refused naming the field.
"""

from __future__ import annotations

import pytest
import torch
from engine_contract_shared import hf_model, teacher_forced_gap
from extras import needs
from test_engine_adapter import BIG, _two_adapters
from tiny_models import build_causal_lm

from cluster.weights.push import WeightSyncError, expected_fingerprint, verify_ack
from learner.config import LoRAConfig
from learner.lora import merged_cpu_state_dict
from rollout_workers.config import RolloutConfig, SamplingConfig, VLLMConfig
from rollout_workers.worker import RolloutWorker

pytestmark = [pytest.mark.slow, *needs("vllm")]

LORA = LoRAConfig(rank=8, alpha=16.0, target_modules="all-linear")


class _NoSwap:
    """An `Interrupt` with no weights due: the interruptible (stepped) path without a swap."""

    version = 1

    def due(self) -> bool:
        return False

    def swap(self) -> None:
        raise AssertionError("nothing is due")


def _merged_model(policy, base_dir, out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.load_state_dict(merged_cpu_state_dict(policy, BIG, keep=True))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return str(out)


def _logprobs(path: str, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Float32 teacher-forced logprobs (temperature 1) of ids[prompt_len:] under the model at `path`."""
    with torch.no_grad():
        logits = hf_model(path)(input_ids=ids[None]).logits[0].float()
    logp = torch.log_softmax(logits[prompt_len - 1 : -1], -1)
    return logp.gather(-1, ids[prompt_len:, None]).squeeze(-1)


def test_vllm_applies_the_adapter_and_refuses_a_stale_one(tmp_path):
    qwen = build_causal_lm(tmp_path / "qwen2", "qwen2", hidden_size=128, intermediate_size=256)
    first, b1, b2, m1, m2 = _two_adapters(qwen, LORA)
    config = RolloutConfig(engine="vllm", lora_sync="adapter", vllm=VLLMConfig(max_lora_rank=LORA.rank))
    worker = RolloutWorker(str(qwen), config)

    ack = worker.load_weights(b1, 1)
    verify_ack("vllm", ack, 1, expected_fingerprint(m1, 1, "float32"))  # probe within 1e-4 of the learner
    assert ack.held is None and ack.changed is True and ack.checksum is None
    merged = _merged_model(first, qwen, tmp_path / "merged1")
    prompts = [torch.tensor([5, 9, 11, 7]).numpy(), torch.tensor([4, 20, 6]).numpy()]
    sampling = SamplingConfig(n=4, max_new_tokens=12)
    samples = worker.generate([0, 1], prompts, seed=3, sampling=sampling)
    assert teacher_forced_gap(merged, samples, 1.0) < 1e-4
    engine = worker._engine
    stepped = engine.generate(prompts, sampling, seed=4, interrupt=_NoSwap())
    for p, outs in zip(prompts, stepped, strict=True):
        for o in outs:
            ids = torch.tensor([*p.tolist(), *o.response_ids.tolist()])
            want = _logprobs(merged, ids, len(p))
            assert (want - torch.from_numpy(o.logprobs)).abs().max() < 1e-4

    real = engine._load_adapter
    engine._load_adapter = lambda state: None  # keeps the older adapter
    with pytest.raises(WeightSyncError, match="kept its previous weights"):
        verify_ack("vllm", worker.load_weights(b2, 2), 2, expected_fingerprint(m2, 2, "float32"))
    engine._load_adapter = real
    verify_ack("vllm", worker.load_weights(b2, 3), 3, expected_fingerprint(m2, 3, "float32"))

    with pytest.raises(ValueError, match="modules_to_save needs rollout.lora_sync='merged'"):
        engine.load_adapter({**b2, "model.norm.weight": torch.ones(128)})
    verify_ack("vllm", worker.fingerprint(), 3, expected_fingerprint({**m2, "digest": None}, 3, "float32"))


def test_a_model_vllm_has_no_lora_for_names_the_field(tmp_path):
    """GPT-2 (the demos' model) has no LoRA in vLLM: building the engine for adapters says what to set."""
    from tiny_models import build_policy

    gpt2 = build_policy(tmp_path / "gpt2", n_embd=64)
    config = RolloutConfig(engine="vllm", lora_sync="adapter", vllm=VLLMConfig(max_lora_rank=4))
    with pytest.raises(ValueError, match="GPT2LMHeadModel does not support LoRA.*rollout.lora_sync='merged'"):
        RolloutWorker(str(gpt2), config)
