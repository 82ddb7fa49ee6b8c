"""Mixtures of experts on vLLM's CPU build (`make test-vllm`): the tiny Qwen3-MoE and Mixtral (4 experts,
top-2; head_dim 32, what vLLM's CPU attention needs) load, generate with behaviour logprobs equal to a
float32 transformers forward, and score the probe as transformers does. A weight push into a running
engine fails inside vLLM 0.32's CPU build (docs/moe.md), so it is not tested here."""

from __future__ import annotations

import pytest
from engine_contract_shared import (
    INDICES,
    PROMPTS,
    TOL,
    probe_gap,
    probe_reference,
    teacher_forced_gap,
)
from extras import needs
from tiny_models import MOE_FAMILIES, build_causal_lm

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.worker import RolloutWorker

pytestmark = [pytest.mark.slow, *needs("vllm")]

WIDE = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_vllm_generates_with_an_moe_and_takes_its_fused_weights(tmp_path, family):
    a = str(build_causal_lm(tmp_path / "a", family, seed=3, **WIDE))
    b = str(build_causal_lm(tmp_path / "b", family, seed=4, **WIDE))
    worker = RolloutWorker(a, RolloutConfig(engine="vllm"), initial_version=0)
    sampling = SamplingConfig(n=2, max_new_tokens=8, temperature=0.8)
    before = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    assert sum(len(s.response_ids) for s in before) > len(before)
    assert teacher_forced_gap(a, before, 0.8) < TOL
    probe = worker.fingerprint().probe
    assert probe_gap(probe, probe_reference(a)) < TOL < probe_gap(probe, probe_reference(b))
