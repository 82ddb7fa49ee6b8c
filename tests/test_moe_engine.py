"""The hf engine with a mixture of experts (tiny Qwen3-MoE and Mixtral): a weight push in the learner's
names (transformers' fused `mlp.experts.gate_up_proj` / `down_proj` stacks) is acknowledged by a probe
equal to the pushed model's, and the samples after it are the pushed model's (float32 teacher forcing)."""

from __future__ import annotations

import pytest
from engine_contract_shared import (
    INDICES,
    PROMPTS,
    TOL,
    bundle_of,
    probe_gap,
    probe_reference,
    teacher_forced_gap,
)
from tiny_models import MOE_FAMILIES, build_causal_lm

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.worker import RolloutWorker


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_hf_engine_takes_a_push_of_fused_expert_weights(tmp_path, family):
    a, b = (str(build_causal_lm(tmp_path / n, family, seed=s)) for n, s in (("a", 3), ("b", 4)))
    worker = RolloutWorker(a, RolloutConfig(engine="hf"), initial_version=0)
    sampling = SamplingConfig(n=2, max_new_tokens=8, temperature=0.8)
    assert teacher_forced_gap(a, worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling), 0.8) < TOL
    bundle = bundle_of(b)
    assert any(k.endswith("mlp.experts.gate_up_proj") and t.ndim == 3 for k, t in bundle.items())
    ack = worker.load_weights(bundle, 1)
    assert probe_gap(ack.probe, probe_reference(b)) < TOL < probe_gap(ack.probe, probe_reference(a))
    assert teacher_forced_gap(b, worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling), 0.8) < TOL
