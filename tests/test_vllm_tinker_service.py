"""`python -m cluster.serve` sampling on the vLLM engine (`rollout.engine: vllm`; `make test-vllm`, so the
service runs in .venv-vllm) driven by the real `tinker` SDK (tests/tinker_client.py in .venv-tinker) on
a tiny Qwen2 built here (vLLM has LoRA for Qwen2, not for GPT-2: tests/test_vllm_adapter.py).

The SDK trains a LoRA client two steps, takes `save_weights_and_get_sampling_client`, samples 3
responses, and scores them teacher-forced with the training client (the learner's forward on the same
adapter); then one more step, a second snapshot into the same vLLM engine, its samples scored the same
way, and the first sampling client sampled again (its snapshot loaded back). Compared: each sampled
token's logprob (temperature 1, no truncation: the full distribution) and the prompt logprobs with the
teacher-forced ones, within the engine contract's float32 tolerance (1e-4, as tests/test_vllm_adapter.py);
the second snapshot's samples with the newer adapter's scores (the older adapter's differ by far more:
lr 0.05 Adam steps); the first client again draws its own samples (same seed, same adapter).
"""

from __future__ import annotations

import numpy as np
import pytest
from extras import needs
from serve_process import serving
from test_tinker_service import KEY, needs_sdk, run_client
from tiny_models import build_causal_lm

pytestmark = [pytest.mark.slow, *needs("vllm")]

MODEL = "tiny-qwen2"
TOLERANCE = 1e-4  # the engine contract's float32 gap between vLLM and a transformers forward


@pytest.fixture(scope="module")
def sampled(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("serve-vllm")
    qwen = build_causal_lm(folder / "qwen2", "qwen2", hidden_size=128, intermediate_size=256)
    config = {
        "api_keys": [KEY],
        "base_models": [{"name": MODEL, "path": str(qwen)}],
        "lora_alpha": 8.0,
        "tenant_cpus": 0.1,  # logical: the tenant and the session's vLLM engine on this small machine
        "rollout": {"engine": "vllm"},  # max_lora_rank unset: room for the first snapshot's rank (4)
    }
    with serving(config, folder) as url:
        return run_client("sample", url, model=MODEL)


@needs_sdk
def test_vllm_samples_the_acknowledged_adapter(sampled):
    p, first = len(sampled["prompt"]), sampled["first"]
    assert len(first["sequences"]) == 3 and len({q["id"] for q in first["sequences"]}) == 3
    for q, forced in zip(first["sequences"], sampled["teacher_forced"], strict=True):
        assert 1 <= len(q["tokens"]) <= 5 and q["stop"] in ("stop", "length")
        np.testing.assert_allclose(q["logprobs"], forced[p - 1 :], atol=TOLERANCE, rtol=0)
        np.testing.assert_allclose(first["prompt_logprobs"][1:], forced[: p - 1], atol=TOLERANCE, rtol=0)
    assert first["prompt_logprobs"][0] is None  # NaN at position 0, which the SDK reads as None


@needs_sdk
def test_a_new_snapshot_samples_the_new_adapter_and_the_old_one_stays(sampled):
    p, first = len(sampled["prompt"]), sampled["first"]["sequences"]
    second = sampled["second"]["sequences"]
    for q, forced in zip(second, sampled["teacher_forced_second"], strict=True):
        np.testing.assert_allclose(q["logprobs"], forced[p - 1 :], atol=TOLERANCE, rtol=0)
    # the step between the snapshots moved the prompt's logprobs by far more than the tolerance
    gap = np.abs(
        np.subtract(sampled["second"]["prompt_logprobs"][1:], sampled["first"]["prompt_logprobs"][1:])
    )
    assert gap.max() > 100 * TOLERANCE
    again = sampled["again"]["sequences"]
    assert [q["tokens"] for q in again] == [q["tokens"] for q in first]
    for q, old in zip(again, first, strict=True):
        np.testing.assert_allclose(q["logprobs"], old["logprobs"], atol=1e-6, rtol=0)
