"""One contract, every rollout engine: `hf` always, `vllm` where vLLM imports (`make test-vllm`).

Through `RolloutWorker`, on a tiny GPT-2 with tied embeddings and head_dim 32 (vLLM's CPU attention
needs >= 32): the same `Sample` records; behaviour logprobs equal to a float32 teacher-forced
transformers forward of the same weights (max gap < 1e-4; measured ~1e-6 for both engines); EOS and
'length' finish reasons; n > 1; same seed -> same samples; a weight swap changes the samples, the new
logprobs match the new weights, and the acknowledgement's probe logprobs are the new weights' (what
the engine computes, not what was sent); versions never go backwards; bundles that do not fit, or
whose tied copies differ, are refused before anything changes; bad input gives a named error.
Sleep / wake-up (`RolloutEngine`'s contract): asleep, the engine refuses to generate, probe or load;
woken from level 1 it gives exactly the samples it gave before; woken from level 2 it refuses until a
bundle loads; sleeping twice or waking an awake engine changes nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.sequences import (
    gather_response,
    pack_sequences,
    probe_sequences,
    response_tokens,
    sequence_logprobs,
)
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.hf_engine import truncate_logits
from rollout_workers.types import Sample
from rollout_workers.worker import RolloutWorker

TOL = 1e-4  # float32 engines against a float32 transformers forward
EOS, VOCAB, CONTEXT = 2, 28, 64
PROMPTS = [np.array([1]), np.array([1, 4, 5, 6]), np.array([1, 4, 5, 6, 9, 10, 11, 12, 13])]
INDICES = [7, 3, 11]

_NO_VLLM = importlib.util.find_spec("vllm") is None
ENGINES = [
    pytest.param("hf", id="hf"),
    pytest.param(
        "vllm",
        id="vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(_NO_VLLM, reason="vllm is not importable here (make test-vllm installs it)"),
        ],
    ),
]


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> tuple[str, str]:
    from tiny_models import build_policy

    root = tmp_path_factory.mktemp("contract")
    return str(build_policy(root / "a", seed=0, n_embd=64)), str(build_policy(root / "b", seed=1, n_embd=64))


@pytest.fixture(scope="module", params=ENGINES)
def worker(request, policies) -> RolloutWorker:
    """One worker per engine for the module; tests that swap weights put policy A back (version up)."""
    return RolloutWorker(policies[0], RolloutConfig(engine=request.param), initial_version=0)


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _teacher_forced(
    path: str, samples: list[Sample], temperature: float, top_k: int = 0, top_p: float = 1.0
) -> float:
    """Max |behaviour logprob - float32 teacher-forced logprob| over every response token, under the
    distribution sampled from (tempered, truncated to top_k/top_p and renormalised)."""
    ids, attn, prompt_lens, rmask = pack_sequences(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], 0
    )
    with torch.no_grad():
        logits = _hf(path)(input_ids=ids, attention_mask=attn).logits.float()
    R = rmask.shape[1]
    scaled = truncate_logits(gather_response(logits, prompt_lens, R) / temperature, top_k, top_p)
    logp = torch.log_softmax(scaled, dim=-1)
    expected = logp.gather(-1, response_tokens(ids, prompt_lens, R).unsqueeze(-1)).squeeze(-1)
    got = torch.zeros_like(expected)
    for i, s in enumerate(samples):
        got[i, : len(s.logprobs)] = torch.from_numpy(s.logprobs)
    return float(torch.where(rmask.bool(), (expected - got).abs(), 0.0).max())  # padding may be -inf


def _probe_reference(path: str) -> list[np.ndarray]:
    model = _hf(path)
    out = []
    with torch.no_grad():
        for seq in probe_sequences(VOCAB):
            ids = torch.from_numpy(seq)
            out.append(sequence_logprobs(model(input_ids=ids[None]).logits[0], ids).numpy())
    return out


def _gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def _key(samples: list[Sample]) -> list[tuple]:
    return [(s.prompt_index, s.sample_index, s.response_ids.tolist()) for s in samples]


def _bundle(path: str) -> dict[str, torch.Tensor]:
    return _hf(path).state_dict()


def test_sample_records_and_finish_reasons(worker):
    version = worker.version()
    samples = worker.generate(INDICES, PROMPTS, seed=0, sampling=SamplingConfig(n=8, max_new_tokens=20))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, k) for i in INDICES for k in range(8)]
    for s, prompt in zip(samples, [p for p in PROMPTS for _ in range(8)], strict=True):
        assert isinstance(s, Sample) and s.policy_version == version
        np.testing.assert_array_equal(s.prompt_ids, prompt)
        assert s.prompt_ids.dtype == s.response_ids.dtype == np.int64
        assert s.logprobs.dtype == np.float32 and s.logprobs.shape == s.response_ids.shape
        assert 1 <= len(s.response_ids) <= 20 and ((s.response_ids >= 0) & (s.response_ids < VOCAB)).all()
        assert np.isfinite(s.logprobs).all() and (s.logprobs <= 0).all()
        assert EOS not in s.response_ids[:-1].tolist()
        if s.finish_reason == "stop":
            assert s.response_ids[-1] == EOS
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 20
    assert {s.finish_reason for s in samples} == {"stop", "length"}
    # n > 1: the samples of one prompt are different draws
    assert len({tuple(s.response_ids.tolist()) for s in samples if s.prompt_index == 11}) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_teacher_forced_forward(worker, policies, temperature):
    samples = worker.generate(
        INDICES, PROMPTS, seed=1, sampling=SamplingConfig(n=4, max_new_tokens=16, temperature=temperature)
    )
    gap = _teacher_forced(policies[0], samples, temperature)
    assert gap < TOL, f"behaviour logprobs differ from the teacher-forced forward by {gap}"


def test_truncated_sampling_records_the_distribution_sampled_from(worker, policies):
    """top_k/top_p on: every token is inside the kept set and its behaviour logprob is that of the
    truncated, renormalised distribution (one rule for every engine), not of the full one."""
    k, p, t = 6, 0.9, 0.8
    samples = worker.generate(
        INDICES,
        PROMPTS,
        seed=3,
        sampling=SamplingConfig(n=4, max_new_tokens=16, temperature=t, top_k=k, top_p=p),
    )
    assert _teacher_forced(policies[0], samples, t, k, p) < TOL
    # Not the full distribution's: renormalising over at most 6 of the tokens raises every logprob.
    assert _teacher_forced(policies[0], samples, t) > 10 * TOL


def test_same_seed_same_samples_other_seed_differs(worker):
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    first = worker.generate(INDICES, PROMPTS, seed=123, sampling=sampling)
    torch.manual_seed(999)  # the global RNG must not matter
    again = worker.generate(INDICES, PROMPTS, seed=123, sampling=sampling)
    other = worker.generate(INDICES, PROMPTS, seed=124, sampling=sampling)
    assert _key(first) == _key(again) and _key(first) != _key(other)
    np.testing.assert_allclose(
        np.concatenate([s.logprobs for s in first]), np.concatenate([s.logprobs for s in again]), atol=1e-6
    )


def test_weight_swap_is_acknowledged_by_what_the_engine_computes(worker, policies):
    a, b = policies
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    start = worker.version()
    probe_a, probe_b = _probe_reference(a), _probe_reference(b)
    assert _gap(worker.fingerprint().probe, probe_a) < TOL
    before = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)

    ack = worker.load_weights(_bundle(b), start + 1)
    assert ack.version == worker.version() == start + 1
    assert _gap(ack.probe, probe_b) < TOL < _gap(ack.probe, probe_a)
    after = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    assert _key(after) != _key(before) and {s.policy_version for s in after} == {start + 1}
    assert _teacher_forced(b, after, 1.0) < TOL  # sampled by the new weights, prefix cache included

    with pytest.raises(ValueError, match=f"holds version {start + 1}; refusing older {start}"):
        worker.load_weights(_bundle(a), start)
    ack = worker.load_weights(_bundle(a), start + 2)  # back to A for the other tests
    assert ack.version == start + 2 and _gap(ack.probe, probe_a) < TOL
    assert _key(worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)) == _key(before)


def test_bundles_that_do_not_fit_are_refused_before_anything_changes(worker, policies):
    good = _bundle(policies[1])
    version, probe = worker.version(), worker.fingerprint().probe
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(good)  # tied, both named
    missing = {k: v for k, v in good.items() if k != "lm_head.weight"}
    with pytest.raises(KeyError, match=r"missing key\(s\) \['lm_head.weight'\]"):
        worker.load_weights(missing, version + 1)
    with pytest.raises(KeyError, match=r"unknown key\(s\) \['v_head.weight'\]"):
        worker.load_weights(dict(good, **{"v_head.weight": torch.zeros(1, 64)}), version + 1)
    with pytest.raises(ValueError, match="transformer.wpe.weight"):
        worker.load_weights(dict(good, **{"transformer.wpe.weight": torch.zeros(3, 64)}), version + 1)
    untied = dict(good, **{"lm_head.weight": good["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="tied weights 'transformer.wte.weight' and 'lm_head.weight' differ"):
        worker.load_weights(untied, version + 1)
    fp = worker.fingerprint()
    assert fp.version == version and _gap(fp.probe, probe) == 0.0  # nothing was loaded


def test_sleep_and_wake_up_keep_the_weights_and_the_version(worker, policies):
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    version, probe = worker.version(), worker.fingerprint().probe
    before = worker.generate(INDICES, PROMPTS, seed=21, sampling=sampling)
    assert worker.sleep()["changed"] is False  # the config's sleep_level is 0: no-op
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        worker.sleep(3)

    facts = worker.sleep(1)
    assert facts["asleep"] and facts["level"] == 1 and facts["changed"] and facts["seconds"] >= 0
    again = worker.sleep(2)  # a second sleep is a no-op and keeps the level
    assert again["asleep"] and again["level"] == 1 and not again["changed"]
    assert worker.stats()["sleep_level"] == 1
    with pytest.raises(RuntimeError, match=r"engine is asleep: wake_up\(\) first"):
        worker.generate(INDICES, PROMPTS, seed=21, sampling=sampling)
    with pytest.raises(RuntimeError, match=r"engine is asleep: wake_up\(\) first"):
        worker.fingerprint()
    with pytest.raises(RuntimeError, match=r"engine is asleep: wake_up\(\) first"):
        worker.load_weights(_bundle(policies[0]), version + 1)
    assert worker.version() == version

    woke = worker.wake_up()
    assert woke["changed"] and not woke["asleep"] and woke["level"] == 0
    assert not worker.wake_up()["changed"]  # waking an awake engine is a no-op
    after = worker.generate(INDICES, PROMPTS, seed=21, sampling=sampling)
    assert _key(after) == _key(before) and {s.policy_version for s in after} == {version}
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    fp = worker.fingerprint()
    assert fp.version == version and _gap(fp.probe, probe) == 0.0
    stats = worker.stats()
    assert stats["sleep_level"] == 0 and stats["sleeps"] >= 1 and stats["wakes"] >= 1


def test_level_two_wake_up_needs_a_weight_load(worker, policies):
    a, b = policies
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    version, sleeps = worker.version(), worker.stats()["sleeps"]
    assert worker.sleep(2)["level"] == 2
    with pytest.raises(RuntimeError, match="engine is asleep"):
        worker.load_weights(_bundle(b), version + 1)
    worker.wake_up()
    unknown = "woke from a level-2 sleep, which discards the weights: the weights are unknown until a full"
    with pytest.raises(RuntimeError, match=unknown):
        worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    with pytest.raises(RuntimeError, match=unknown):
        worker.fingerprint()
    missing = {k: v for k, v in _bundle(b).items() if k != "lm_head.weight"}
    with pytest.raises(KeyError, match="missing key"):
        worker.load_weights(missing, version + 1)  # a refused bundle leaves the weights unknown
    with pytest.raises(RuntimeError, match=unknown):
        worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)

    ack = worker.load_weights(_bundle(b), version + 1)  # the push after the wake-up
    assert ack.version == worker.version() == version + 1
    assert _gap(ack.probe, _probe_reference(b)) < TOL
    samples = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    assert {s.policy_version for s in samples} == {version + 1} and _teacher_forced(b, samples, 1.0) < TOL
    ack = worker.load_weights(_bundle(a), version + 2)  # back to A for the other tests
    assert _gap(ack.probe, _probe_reference(a)) < TOL
    assert worker.stats()["sleeps"] == sleeps + 1


def test_hf_sleeps_at_the_configured_level(policies):
    worker = RolloutWorker(policies[0], RolloutConfig(engine="hf", sleep_level=2))
    facts = worker.sleep()
    assert facts["level"] == 2 and facts["changed"] and worker.stats()["sleeps"] == 1
    assert worker.wake_up()["changed"]
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        worker.fingerprint()
    assert worker.load_weights(_bundle(policies[0]), 0).version == 0  # the same version may be pushed again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading frees GPU memory: needs a GPU")
def test_hf_sleep_frees_gpu_memory(policies):
    worker = RolloutWorker(policies[0], RolloutConfig(engine="hf", sleep_level=1))
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    before = worker.generate(INDICES, PROMPTS, seed=3, sampling=sampling)
    held = torch.cuda.memory_allocated()
    worker.sleep()
    assert torch.cuda.memory_allocated() < held
    worker.wake_up()
    assert _key(worker.generate(INDICES, PROMPTS, seed=3, sampling=sampling)) == _key(before)


@pytest.mark.vllm
@pytest.mark.skipif(_NO_VLLM, reason="vllm is not importable here (make test-vllm installs it)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU build has no sleep mode; GPUs do")
def test_vllm_on_cpu_refuses_a_sleep_level(policies):
    with pytest.raises(
        ValueError, match=r"rollout\.sleep_level=1: vLLM sleep mode needs a CUDA/ROCm/XPU GPU"
    ):
        RolloutWorker(policies[0], RolloutConfig(engine="vllm", sleep_level=1))


def test_bad_input_gives_a_named_error(worker):
    sampling = SamplingConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 42 must be a non-empty"):
        worker.generate([1, 42], [PROMPTS[0], np.array([], dtype=np.int64)], seed=0, sampling=sampling)
    with pytest.raises(ValueError, match=rf"prompt 9 has token ids outside \[0, {VOCAB}\)"):
        worker.generate([9], [np.array([1, VOCAB])], seed=0, sampling=sampling)
    with pytest.raises(ValueError, match=f"prompt 4 has 60 tokens.*exceeds the model's {CONTEXT} positions"):
        worker.generate([4], [np.ones(60, dtype=np.int64)], seed=0, sampling=sampling)
    assert len(worker.generate([4], [np.ones(CONTEXT - 8, dtype=np.int64)], seed=0, sampling=sampling)) == 1


@pytest.mark.vllm
@pytest.mark.skipif(_NO_VLLM, reason="vllm is not importable here (make test-vllm installs it)")
def test_vllm_tensor_parallel_swap_loads_every_shard(policies):
    """tensor_parallel_size=2 on CPU (vLLM's mp executor, two worker processes): each rank takes its
    shard of the same bundle bytes, and the probe shows the whole model changed."""
    from rollout_workers.config import VLLMConfig

    a, b = policies
    worker = RolloutWorker(a, RolloutConfig(engine="vllm", vllm=VLLMConfig(tensor_parallel_size=2)))
    assert _gap(worker.fingerprint().probe, _probe_reference(a)) < TOL
    samples = worker.generate(INDICES, PROMPTS, seed=1, sampling=SamplingConfig(n=2, max_new_tokens=12))
    assert _teacher_forced(a, samples, 1.0) < TOL
    ack = worker.load_weights(_bundle(b), 1)
    assert _gap(ack.probe, _probe_reference(b)) < TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("engine", ENGINES)
def test_low_precision_engines_pass_the_probe_and_stale_weights_do_not(policies, engine, dtype):
    """The acknowledgement tolerance (cluster.weights.push.PROBE_TOLERANCE) admits a bf16/fp16 engine on
    the float32 learner's weights and still names one that kept other weights."""
    from cluster.weights.push import WeightSyncError, expected_fingerprint, verify_ack

    a, b = policies
    worker = RolloutWorker(a, RolloutConfig(engine=engine, dtype=dtype))
    want_b = expected_fingerprint(
        {"probe": _probe_reference(b), "checksum": None, "dtype": "float32"}, 1, dtype
    )
    stale = worker.fingerprint()
    ack = worker.load_weights(_bundle(b), 1)
    verify_ack("w", dataclasses.replace(ack, checksum=None), 1, want_b)
    with pytest.raises(WeightSyncError, match="w does not compute what the learner's v1 weights compute"):
        verify_ack("w", dataclasses.replace(stale, version=1, checksum=None), 1, want_b)


def _one_adam_step(state: dict[str, torch.Tensor], path: str, seed: int) -> dict[str, torch.Tensor]:
    """The bundle after one AdamW step at the sentiment demo's learning rate (2e-4) on the NLL of a few
    random sequences: the size of change one PPO step makes to every weight with a gradient."""
    model = _hf(path)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    ids = torch.from_numpy(np.random.default_rng(seed).integers(3, VOCAB, size=(4, 12)))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("engine", ENGINES)
def test_one_optimizer_step_is_told_apart_and_a_stale_engine_refused(policies, engine, dtype):
    """Digests tell v from v+1 after one step in both dtypes and both engines: hf reads its weights
    back under the bundle's names (exact); vLLM's own (fused, renamed) parameters must change when the
    bundle does. An engine whose load became a no-op is refused; the honest loads pass."""
    from cluster.weights.push import Fingerprint, WeightSyncError, verify_ack
    from rollout_workers.weights import sampled_digest, torch_dtype

    a, _ = policies
    worker = RolloutWorker(a, RolloutConfig(engine=engine, dtype=dtype))
    v1 = _bundle(a)
    v2 = _one_adam_step(v1, a, seed=1)
    v3 = _one_adam_step(v2, a, seed=2)

    def expect(version, bundle, ack):  # the probe is the engine's own here: the digests are under test
        return Fingerprint(
            version, ack.probe, None, 1e-4, 1e-5, sampled_digest(bundle.items(), torch_dtype(dtype))
        )

    for version, bundle in ((1, v1), (2, v2)):
        ack = worker.load_weights(bundle, version)
        verify_ack("w", ack, version, expect(version, bundle, ack))
        assert ack.received != expect(version, v1 if version == 2 else v2, ack).digest  # one step shows
    assert ack.held is not None or (ack.changed and ack.bundle_changed)  # hf: exact; vLLM: it moved
    worker._engine._load_weights = lambda state: None  # the engine now ignores every load
    ack = worker.load_weights(v3, 3)
    with pytest.raises(WeightSyncError, match="w (holds weights that are not v3|kept its previous weights)"):
        verify_ack("w", ack, 3, expect(3, v3, ack))


def _send_in_thread(state: dict, world: int, version: int, timeout: float = 60.0, hold: bool = False):
    """Learner rank 0's side of the weight group, in a thread of this process: open the group on a free
    port, broadcast `state` tagged `version` in ~8 kB buckets (unless `hold`: then send nothing).
    Returns (port, thread, result list: bytes sent or the exception)."""
    import socket
    import threading

    from learner.weight_broadcast import broadcast_state, open_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out: list = []

    def run() -> None:
        try:
            group = open_group("127.0.0.1", port, 0, world, timeout)
            out.append(0 if hold else broadcast_state(group, state, version, 8192, timeout))
            if hold:
                out.append(group)  # keep it open, silent
        except Exception as err:  # noqa: BLE001 - handed to the test
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return port, thread, out


@pytest.mark.parametrize("engine", ENGINES)
def test_broadcast_swap_loads_bucket_by_bucket_like_a_bundle(policies, engine):
    """The collective path: the engine's weight-holding processes (vLLM: inside vLLM, both
    tensor-parallel ranks) join a weight group and load a broadcast bucket by bucket. The ack equals
    the object-store load of the same bundle; a bundle that does not fit is refused with nothing
    changed and the group stays in step for the next one; a silent sender times out, named."""
    from rollout_workers.config import VLLMConfig
    from rollout_workers.weight_receiver import WeightGroupError
    from rollout_workers.weights import sampled_digest

    a, b = policies
    tp = 2 if engine == "vllm" else 1
    worker = RolloutWorker(a, RolloutConfig(engine=engine, vllm=VLLMConfig(tensor_parallel_size=tp)))
    world = 1 + worker.weight_receivers()
    assert world == 1 + tp
    state_b = _bundle(b)
    port, thread, out = _send_in_thread(state_b, world, 3)
    worker.join_weight_group("127.0.0.1", port, 1, world, 60.0)
    ack = worker.receive_weights()
    thread.join(60)
    assert out[0] > 0 and ack.version == 3
    assert ack.received == sampled_digest(state_b.items(), torch.float32)
    assert _gap(ack.probe, _probe_reference(b)) < TOL
    assert ack.bundle_changed is None and (ack.changed is None or ack.changed)
    same = worker.load_weights(state_b, 4)  # the object-store path, same bundle: the same weights
    assert same.received == ack.received and _gap(same.probe, ack.probe) == 0.0

    wrong = {k: (v[:-1] if k.endswith("wpe.weight") else v) for k, v in _bundle(a).items()}
    port, thread, out = _send_in_thread(wrong, world, 5)
    worker.join_weight_group("127.0.0.1", port, 1, world, 60.0)
    with pytest.raises((KeyError, ValueError), match="shapes do not match"):
        worker.receive_weights()
    thread.join(60)
    assert worker.version() == 4 and _gap(worker.fingerprint().probe, ack.probe) == 0.0
    assert len(worker.generate(INDICES, PROMPTS, seed=0, sampling=SamplingConfig(max_new_tokens=4))) == 3

    port, thread, out = _send_in_thread(state_b, world, 6, timeout=3.0, hold=True)
    worker.join_weight_group("127.0.0.1", port, 1, world, 3.0)
    with pytest.raises(WeightGroupError, match="weight broadcast \\(header\\)"):
        worker.receive_weights()
    assert worker.version() == 4  # nothing arrived: the weights are those of v4
