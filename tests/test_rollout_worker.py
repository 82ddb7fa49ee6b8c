"""RolloutWorker with the transformers engine, on the tiny random GPT-2 policy."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kernel.sequences import gather_response, pack_sequences, response_tokens
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.hf_engine import truncate_logits
from rollout_workers.types import Sample
from rollout_workers.weights import state_checksum
from rollout_workers.worker import RolloutWorker, make_engine

EOS, VOCAB = 2, 28
# Different lengths (1, 4 and 9 tokens) so left padding and position ids are exercised.
PROMPTS = [np.array([1]), np.array([1, 4, 5, 6]), np.array([1, 4, 5, 6, 9, 10, 11, 12, 13])]
INDICES = [7, 3, 11]


@pytest.fixture(scope="module")
def other_policy_dir(tmp_path_factory):
    from tiny_models import build_policy

    return build_policy(tmp_path_factory.mktemp("tiny_policy_other"), seed=1)


def _worker(path, **sampling) -> RolloutWorker:
    return RolloutWorker(str(path), RolloutConfig(sampling=SamplingConfig(**sampling)))


def _bundle(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def _teacher_forced(
    path, samples: list[Sample], temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of the sampled tokens under a plain right-padded forward, as the learner computes them
    (with top_k/top_p: of the truncated, renormalised distribution the tokens were drawn from)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids, attn, prompt_lens, rmask = pack_sequences(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], 0
    )
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
    R = rmask.shape[1]
    scaled = truncate_logits(gather_response(logits, prompt_lens, R) / temperature, top_k, top_p)
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, response_tokens(ids, prompt_lens, R).unsqueeze(-1)).squeeze(-1), rmask


def _behaviour(samples: list[Sample]) -> torch.Tensor:
    out = torch.zeros(len(samples), max(len(s.logprobs) for s in samples))
    for i, s in enumerate(samples):
        out[i, : len(s.logprobs)] = torch.from_numpy(s.logprobs)
    return out


def _key(samples: list[Sample]) -> list[tuple]:
    return [(s.prompt_index, s.sample_index, s.response_ids.tolist()) for s in samples]


def test_samples_are_well_formed(tiny_policy_dir):
    worker = RolloutWorker(
        str(tiny_policy_dir),
        RolloutConfig(sampling=SamplingConfig(n=8, max_new_tokens=20)),
        initial_version=5,
    )
    samples = worker.generate(INDICES, PROMPTS, seed=0)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, k) for i in INDICES for k in range(8)]
    for s, prompt in zip(samples, [p for p in PROMPTS for _ in range(8)], strict=True):
        assert s.policy_version == 5
        np.testing.assert_array_equal(s.prompt_ids, prompt)
        assert s.prompt_ids.dtype == s.response_ids.dtype == np.int64
        assert s.logprobs.dtype == np.float32 and s.logprobs.shape == s.response_ids.shape
        assert 1 <= len(s.response_ids) <= 20
        assert ((s.response_ids >= 0) & (s.response_ids < VOCAB)).all()
        assert np.isfinite(s.logprobs).all() and (s.logprobs <= 0).all()
        assert EOS not in s.response_ids[:-1].tolist()
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == EOS
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 20 and s.response_ids[-1] != EOS
    assert {s.finish_reason for s in samples} == {"stop", "length"}  # both branches were checked
    stats = worker.stats()
    assert stats["samples"] == 24 and stats["prompts"] == 3
    assert stats["tokens"] == sum(len(s.response_ids) for s in samples) and stats["busy_s"] > 0


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["t1.0", "t0.7", "t0.7-topk-topp"],
)
def test_behaviour_logprobs_match_teacher_forced_forward(tiny_policy_dir, sampling):
    worker = _worker(tiny_policy_dir, n=4, max_new_tokens=16, **sampling)
    samples = worker.generate(INDICES, PROMPTS, seed=1)
    expected, mask = _teacher_forced(tiny_policy_dir, samples, **sampling)
    gap = torch.where(mask.bool(), (expected - _behaviour(samples)).abs(), 0.0).max().item()  # pad: -inf
    assert gap < 1e-4, f"behaviour logprobs differ from the teacher-forced forward by {gap}"


def test_truncated_sampling_stays_inside_top_k(tiny_policy_dir):
    worker = _worker(tiny_policy_dir, n=8, max_new_tokens=16, temperature=1.0, top_k=3)
    samples = worker.generate(INDICES, PROMPTS, seed=2)
    full, mask = _teacher_forced(tiny_policy_dir, samples, 1.0)
    # The model is near uniform over 28 tokens: rank <= 3 for every one of ~300 tokens is no accident.
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
    for s in samples:
        seq = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]))[None]
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(s.prompt_ids) - 1 : -1]
        top3 = torch.topk(logits, 3, dim=-1).indices
        assert (top3 == torch.from_numpy(s.response_ids)[:, None]).any(-1).all()


def test_truncate_logits_top_k_and_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda out: torch.isfinite(out)[0].tolist()  # noqa: E731
    assert kept(truncate_logits(logits, 0, 1.0)) == [True] * 4
    assert kept(truncate_logits(logits, 2, 1.0)) == [True, True, False, False]
    assert kept(truncate_logits(logits, 0, 0.8)) == [True, True, False, False]
    assert kept(truncate_logits(logits, 0, 0.81)) == [True, True, True, False]
    assert kept(truncate_logits(logits, 0, 0.1)) == [True, False, False, False]
    assert kept(truncate_logits(logits[:, [3, 1, 0, 2]], 0, 0.8)) == [False, True, True, False]


def test_same_seed_same_samples_other_seed_differs(tiny_policy_dir):
    worker = _worker(tiny_policy_dir, n=2, max_new_tokens=12)
    first = worker.generate(INDICES, PROMPTS, seed=123)
    again = worker.generate(INDICES, PROMPTS, seed=123)
    torch.manual_seed(999)  # the global RNG must not matter
    fresh = _worker(tiny_policy_dir, n=2, max_new_tokens=12).generate(INDICES, PROMPTS, seed=123)
    other = worker.generate(INDICES, PROMPTS, seed=124)
    assert _key(first) == _key(again) == _key(fresh)
    np.testing.assert_array_equal(
        np.concatenate([s.logprobs for s in first]), np.concatenate([s.logprobs for s in fresh])
    )
    assert _key(first) != _key(other)


def test_load_weights_switches_policy_and_reports_version_and_checksum(tiny_policy_dir, other_policy_dir):
    worker = _worker(tiny_policy_dir, n=2, max_new_tokens=12)
    before = worker.generate(INDICES, PROMPTS, seed=5)
    old_sum = worker.checksum()
    assert old_sum == state_checksum(_bundle(tiny_policy_dir), torch.float32)

    bundle = _bundle(other_policy_dir)
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(bundle)  # tied GPT-2 embeddings, both named
    ack = worker.load_weights(bundle, version=1)
    version, checksum = ack.version, ack.checksum
    assert (version, checksum) == (1, state_checksum(bundle, torch.float32))
    assert checksum != old_sum and worker.checksum() == checksum and worker.version() == 1

    after = worker.generate(INDICES, PROMPTS, seed=5)
    assert _key(after) != _key(before) and {s.policy_version for s in after} == {1}
    expected, mask = _teacher_forced(other_policy_dir, after, 1.0)  # sampled by the new weights
    assert ((expected - _behaviour(after)).abs() * mask).max().item() < 1e-4
    model = worker._engine.model
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
    assert worker.stats()["weight_loads"] == 1


def test_load_weights_casts_to_the_engine_dtype(tiny_policy_dir, other_policy_dir):
    worker = RolloutWorker(str(tiny_policy_dir), RolloutConfig(dtype="bfloat16"))
    bundle = _bundle(other_policy_dir)
    checksum = worker.load_weights(bundle, version=2).checksum
    assert checksum == state_checksum(bundle, torch.bfloat16) != state_checksum(bundle)
    assert worker.generate([0], PROMPTS[:1], seed=0)[0].logprobs.dtype == np.float32


def test_load_weights_rejects_bundles_that_do_not_fit(tiny_policy_dir, other_policy_dir):
    worker = _worker(tiny_policy_dir)
    good = _bundle(other_policy_dir)
    checksum = worker.checksum()
    missing = {k: v for k, v in good.items() if k != "lm_head.weight"}
    with pytest.raises(KeyError, match=r"missing key\(s\) \['lm_head.weight'\]"):
        worker.load_weights(missing, version=1)
    with pytest.raises(KeyError, match=r"unknown key\(s\) \['v_head.weight'\]"):
        worker.load_weights(dict(good, **{"v_head.weight": torch.zeros(1, 32)}), version=1)
    with pytest.raises(ValueError, match="transformer.wpe.weight"):
        worker.load_weights(dict(good, **{"transformer.wpe.weight": torch.zeros(3, 32)}), version=1)
    with pytest.raises(ValueError, match="tied weights"):
        worker.load_weights(dict(good, **{"lm_head.weight": good["lm_head.weight"] + 1}), version=1)
    assert worker.version() == 0 and worker.checksum() == checksum  # nothing was half-loaded
    worker.load_weights(good, version=3)
    with pytest.raises(ValueError, match="holds version 3; refusing older 2"):
        worker.load_weights(good, version=2)


def test_generate_validates_prompts(tiny_policy_dir):
    worker = _worker(tiny_policy_dir, max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 42 must be a non-empty"):
        worker.generate([1, 42], [PROMPTS[0], np.array([], dtype=np.int64)], seed=0)
    with pytest.raises(ValueError, match=r"prompt 9 has token ids outside \[0, 28\)"):
        worker.generate([9], [np.array([1, 28])], seed=0)
    with pytest.raises(ValueError, match="prompt 4 has 60 tokens"):  # 64 positions in the tiny GPT-2
        worker.generate([4], [np.ones(60, dtype=np.int64)], seed=0)
    with pytest.raises(ValueError, match="2 prompt indices but 1 prompts"):
        worker.generate([0, 1], PROMPTS[:1], seed=0)
    assert worker.generate([], [], seed=0) == []
    assert worker.stats()["generate_calls"] == 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is importable here")
def test_vllm_engine_without_vllm_says_what_to_do(tiny_policy_dir):
    with pytest.raises(RuntimeError, match=r"needs the vllm package.*rayppo\[vllm\].*engine='hf'"):
        make_engine(str(tiny_policy_dir), RolloutConfig(engine="vllm"))
