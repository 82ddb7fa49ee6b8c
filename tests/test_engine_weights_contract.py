"""One contract, every rollout engine: `hf` always, `vllm` where vLLM imports (`make test-vllm`).
This half: weights, and sleep / wake-up.

A weight swap changes the samples, the new logprobs match the new weights, and the acknowledgement's
probe logprobs are the new weights' (what the engine computes, not what was sent); versions never go
backwards; bundles that do not fit, or whose tied copies differ, are refused before anything changes;
a tensor-parallel vLLM swap loads every shard; the acknowledgement tolerance admits bf16/fp16 engines
and names stale ones; digests tell one optimizer step apart; the broadcast path loads bucket by
bucket like a bundle. Sleep / wake-up (`RolloutEngine`'s contract): asleep, the engine refuses to
generate, probe or load; woken from level 1 it gives exactly the samples it gave before; woken from
level 2 it refuses until a bundle loads; sleeping twice or waking an awake engine changes nothing.
Generation is tests/test_engine_contract.py; the shared parts are tests/engine_contract_shared.py.
"""

from __future__ import annotations

import dataclasses

import engine_contract_shared
import numpy as np
import pytest
import torch
from engine_contract_shared import (
    ENGINES,
    INDICES,
    NO_VLLM,
    PROMPTS,
    TOL,
    VOCAB,
    bundle_of,
    hf_model,
    probe_gap,
    probe_reference,
    sample_key,
    teacher_forced_gap,
)

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.worker import RolloutWorker

# The shared module-scoped fixtures (this module gets its own policies and one worker per engine).
policies, worker = engine_contract_shared.policies, engine_contract_shared.worker


def test_weight_swap_is_acknowledged_by_what_the_engine_computes(worker, policies):
    a, b = policies
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    start = worker.version()
    probe_a, probe_b = probe_reference(a), probe_reference(b)
    assert probe_gap(worker.fingerprint().probe, probe_a) < TOL
    before = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)

    ack = worker.load_weights(bundle_of(b), start + 1)
    assert ack.version == worker.version() == start + 1
    assert probe_gap(ack.probe, probe_b) < TOL < probe_gap(ack.probe, probe_a)
    after = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    assert sample_key(after) != sample_key(before) and {s.policy_version for s in after} == {start + 1}
    assert teacher_forced_gap(b, after, 1.0) < TOL  # sampled by the new weights, prefix cache included

    with pytest.raises(ValueError, match=f"holds version {start + 1}; refusing older {start}"):
        worker.load_weights(bundle_of(a), start)
    ack = worker.load_weights(bundle_of(a), start + 2)  # back to A for the other tests
    assert ack.version == start + 2 and probe_gap(ack.probe, probe_a) < TOL
    assert sample_key(worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)) == sample_key(before)


def test_bundles_that_do_not_fit_are_refused_before_anything_changes(worker, policies):
    good = bundle_of(policies[1])
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
    assert fp.version == version and probe_gap(fp.probe, probe) == 0.0  # nothing was loaded


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
        worker.load_weights(bundle_of(policies[0]), version + 1)
    assert worker.version() == version

    woke = worker.wake_up()
    assert woke["changed"] and not woke["asleep"] and woke["level"] == 0
    assert not worker.wake_up()["changed"]  # waking an awake engine is a no-op
    after = worker.generate(INDICES, PROMPTS, seed=21, sampling=sampling)
    assert sample_key(after) == sample_key(before) and {s.policy_version for s in after} == {version}
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    fp = worker.fingerprint()
    assert fp.version == version and probe_gap(fp.probe, probe) == 0.0
    stats = worker.stats()
    assert stats["sleep_level"] == 0 and stats["sleeps"] >= 1 and stats["wakes"] >= 1


def test_level_two_wake_up_needs_a_weight_load(worker, policies):
    a, b = policies
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    version, sleeps = worker.version(), worker.stats()["sleeps"]
    assert worker.sleep(2)["level"] == 2
    with pytest.raises(RuntimeError, match="engine is asleep"):
        worker.load_weights(bundle_of(b), version + 1)
    worker.wake_up()
    unknown = "woke from a level-2 sleep, which discards the weights: the weights are unknown until a full"
    with pytest.raises(RuntimeError, match=unknown):
        worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    with pytest.raises(RuntimeError, match=unknown):
        worker.fingerprint()
    missing = {k: v for k, v in bundle_of(b).items() if k != "lm_head.weight"}
    with pytest.raises(KeyError, match="missing key"):
        worker.load_weights(missing, version + 1)  # a refused bundle leaves the weights unknown
    with pytest.raises(RuntimeError, match=unknown):
        worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)

    ack = worker.load_weights(bundle_of(b), version + 1)  # the push after the wake-up
    assert ack.version == worker.version() == version + 1
    assert probe_gap(ack.probe, probe_reference(b)) < TOL
    samples = worker.generate(INDICES, PROMPTS, seed=5, sampling=sampling)
    assert {s.policy_version for s in samples} == {version + 1} and teacher_forced_gap(b, samples, 1.0) < TOL
    ack = worker.load_weights(bundle_of(a), version + 2)  # back to A for the other tests
    assert probe_gap(ack.probe, probe_reference(a)) < TOL
    assert worker.stats()["sleeps"] == sleeps + 1


def test_hf_sleeps_at_the_configured_level(policies):
    worker = RolloutWorker(policies[0], RolloutConfig(engine="hf", sleep_level=2))
    facts = worker.sleep()
    assert facts["level"] == 2 and facts["changed"] and worker.stats()["sleeps"] == 1
    assert worker.wake_up()["changed"]
    with pytest.raises(RuntimeError, match="level-2 sleep"):
        worker.fingerprint()
    assert worker.load_weights(bundle_of(policies[0]), 0).version == 0  # the same version may be pushed again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading frees GPU memory: needs a GPU")
def test_hf_sleep_frees_gpu_memory(policies):
    worker = RolloutWorker(policies[0], RolloutConfig(engine="hf", sleep_level=1))
    sampling = SamplingConfig(n=2, max_new_tokens=12)
    before = worker.generate(INDICES, PROMPTS, seed=3, sampling=sampling)
    held = torch.cuda.memory_allocated()
    worker.sleep()
    assert torch.cuda.memory_allocated() < held
    worker.wake_up()
    assert sample_key(worker.generate(INDICES, PROMPTS, seed=3, sampling=sampling)) == sample_key(before)


@pytest.mark.vllm
@pytest.mark.skipif(NO_VLLM, reason="vllm is not importable here (make test-vllm installs it)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU build has no sleep mode; GPUs do")
def test_vllm_on_cpu_refuses_a_sleep_level(policies):
    with pytest.raises(
        ValueError, match=r"rollout\.sleep_level=1: vLLM sleep mode needs a CUDA/ROCm/XPU GPU"
    ):
        RolloutWorker(policies[0], RolloutConfig(engine="vllm", sleep_level=1))


@pytest.mark.vllm
@pytest.mark.skipif(NO_VLLM, reason="vllm is not importable here (make test-vllm installs it)")
def test_vllm_tensor_parallel_swap_loads_every_shard(policies):
    """tensor_parallel_size=2 on CPU (vLLM's mp executor, two worker processes): each rank takes its
    shard of the same bundle bytes, and the probe shows the whole model changed."""
    from rollout_workers.config import VLLMConfig

    a, b = policies
    worker = RolloutWorker(a, RolloutConfig(engine="vllm", vllm=VLLMConfig(tensor_parallel_size=2)))
    assert probe_gap(worker.fingerprint().probe, probe_reference(a)) < TOL
    samples = worker.generate(INDICES, PROMPTS, seed=1, sampling=SamplingConfig(n=2, max_new_tokens=12))
    assert teacher_forced_gap(a, samples, 1.0) < TOL
    ack = worker.load_weights(bundle_of(b), 1)
    assert probe_gap(ack.probe, probe_reference(b)) < TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("engine", ENGINES)
def test_low_precision_engines_pass_the_probe_and_stale_weights_do_not(policies, engine, dtype):
    """The acknowledgement tolerance (cluster.weights.push.PROBE_TOLERANCE) admits a bf16/fp16 engine on
    the float32 learner's weights and still names one that kept other weights."""
    from cluster.weights.push import WeightSyncError, expected_fingerprint, verify_ack

    a, b = policies
    worker = RolloutWorker(a, RolloutConfig(engine=engine, dtype=dtype))
    want_b = expected_fingerprint(
        {"probe": probe_reference(b), "checksum": None, "dtype": "float32"}, 1, dtype
    )
    stale = worker.fingerprint()
    ack = worker.load_weights(bundle_of(b), 1)
    verify_ack("w", dataclasses.replace(ack, checksum=None), 1, want_b)
    with pytest.raises(WeightSyncError, match="w does not compute what the learner's v1 weights compute"):
        verify_ack("w", dataclasses.replace(stale, version=1, checksum=None), 1, want_b)


def _one_adam_step(state: dict[str, torch.Tensor], path: str, seed: int) -> dict[str, torch.Tensor]:
    """The bundle after one AdamW step at the sentiment demo's learning rate (2e-4) on the NLL of a few
    random sequences: the size of change one PPO step makes to every weight with a gradient."""
    model = hf_model(path)
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
    v1 = bundle_of(a)
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


def _send_in_thread(
    state: dict, world: int, version: int, timeout: float = 60.0, hold: bool = False, segment=None
):
    """Learner rank 0's side of the weight group, in a thread of this process: open the group on a free
    port, broadcast `state` tagged `version` in ~8 kB buckets (unless `hold`: then send nothing), or
    with `segment` (learner.shared_bundle) write them there and broadcast the header alone.
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
            out.append(0 if hold else broadcast_state(group, state, version, 8192, timeout, segment=segment))
            if hold:
                out.append(group)  # keep it open, silent
        except Exception as err:  # noqa: BLE001 - handed to the test
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return port, thread, out


@pytest.mark.parametrize("engine", ENGINES)
def test_broadcast_swap_loads_bucket_by_bucket_like_a_bundle(policies, engine, tmp_path):
    """The collective path: the engine's weight-holding processes (vLLM: inside vLLM, both
    tensor-parallel ranks) join a weight group and load a broadcast bucket by bucket. The ack equals
    the object-store load of the same bundle; a bundle that does not fit is refused with nothing
    changed and the group stays in step for the next one; a silent sender times out, named."""
    from learner.shared_bundle import SharedSegment
    from rollout_workers.config import VLLMConfig
    from rollout_workers.weight_receiver import WeightGroupError
    from rollout_workers.weights import sampled_digest

    a, b = policies
    tp = 2 if engine == "vllm" else 1
    worker = RolloutWorker(a, RolloutConfig(engine=engine, vllm=VLLMConfig(tensor_parallel_size=tp)))
    world = 1 + worker.weight_receivers()
    assert world == 1 + tp
    state_b = bundle_of(b)
    port, thread, out = _send_in_thread(state_b, world, 3)
    worker.join_weight_group("127.0.0.1", port, 1, world, 60.0)
    ack = worker.receive_weights()
    thread.join(60)
    assert out[0] > 0 and ack.version == 3
    assert ack.received == sampled_digest(state_b.items(), torch.float32)
    assert probe_gap(ack.probe, probe_reference(b)) < TOL
    assert ack.bundle_changed is None and (ack.changed is None or ack.changed)
    same = worker.load_weights(state_b, 4)  # the object-store path, same bundle: the same weights
    assert same.received == ack.received and probe_gap(same.probe, ack.probe) == 0.0

    # through shared memory (every member on this host): the header names the segment, the receivers
    # (vLLM's worker processes too) read the buckets there; the same weights, then the next bundle in
    # the same segment, mapped once
    segment = SharedSegment.create(str(tmp_path))
    for version, state, want in ((5, state_b, ack), (6, bundle_of(a), None)):
        port, thread, out = _send_in_thread(state, world, version, segment=segment)
        worker.join_weight_group("127.0.0.1", port, 1, world, 60.0)
        got = worker.receive_weights()
        thread.join(60)
        assert out[0] == sum(
            t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values()
        )
        assert got.version == version and got.received == sampled_digest(state.items(), torch.float32)
        if want is not None:
            assert probe_gap(got.probe, want.probe) == 0.0
    assert probe_gap(got.probe, probe_reference(a)) < TOL
    segment.remove()  # a receiver that cannot open the segment says where to look
    port, thread, out = _send_in_thread(state_b, world, 7, segment=segment)
    worker.join_weight_group("127.0.0.1", port, 1, world, 60.0)
    with pytest.raises(WeightGroupError, match="shared weight segment .* cannot be opened here"):
        worker.receive_weights()
    thread.join(60)
    worker.load_weights(state_b, 7)

    wrong = {k: (v[:-1] if k.endswith("wpe.weight") else v) for k, v in bundle_of(a).items()}
    port, thread, out = _send_in_thread(wrong, world, 8)
    worker.join_weight_group("127.0.0.1", port, 1, world, 60.0)
    with pytest.raises((KeyError, ValueError), match="shapes do not match"):
        worker.receive_weights()
    thread.join(60)
    assert worker.version() == 7 and probe_gap(worker.fingerprint().probe, ack.probe) == 0.0
    assert len(worker.generate(INDICES, PROMPTS, seed=0, sampling=SamplingConfig(max_new_tokens=4))) == 3

    port, thread, out = _send_in_thread(state_b, world, 9, timeout=3.0, hold=True)
    worker.join_weight_group("127.0.0.1", port, 1, world, 3.0)
    with pytest.raises(WeightGroupError, match="weight broadcast \\(header\\)"):
        worker.receive_weights()
    assert worker.version() == 7  # nothing arrived: the weights are those of v7
