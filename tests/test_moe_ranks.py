"""Mixture-of-experts policies on real DeepSpeed learner ranks (gloo on CPU): 2 ranks whose data route
unevenly (one rank's micro-batches leave experts of every layer unused) finish the step and take the
step one rank takes on the union, under ZeRO-3 (every tensor sharded) and ZeRO-2; the same with
rollout routing replay (learner.router_replay R3 on an engine's recorded routing, and R2), LoRA on the
experts too.

The uneven routing is built, not hoped for: a sequence of one repeated token has the same hidden state
at every position (attention averages identical value vectors), so every position of it routes to the
same top-2 experts in every layer; the test counts the router's choices to show it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import MOE_FAMILIES, build_causal_lm
from transformers import AutoModelForCausalLM

from learner.trajectory import Trajectory

pytestmark = pytest.mark.slow

REPEATED = 9  # the one token of the narrow rank's sequences


def _narrow(n: int, seed: int) -> list[Trajectory]:
    """`n` sequences of one repeated token, all of one length (no padding in their micro-batches)."""
    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            prompt_ids=np.full(3, REPEATED),
            response_ids=np.full(4, REPEATED),
            behaviour_logprobs=rng.normal(-3.3, 0.2, 4).astype(np.float32),
            ref_logprobs=rng.normal(-3.3, 0.2, 4).astype(np.float32),
            score=float(rng.normal()),
        )
        for _ in range(n)
    ]


def expert_hits(model, sequences: list[np.ndarray]) -> list[set[int]]:
    """Per MoE layer, the experts the router picks for any position of `sequences` (one forward each)."""
    routers = [layer.mlp.gate for layer in model.model.layers]
    hits: list[set[int]] = [set() for _ in routers]

    def record(i):
        return lambda module, args, out: hits[i].update(
            out[2].flatten().tolist()
        )  # (logits, weights, indices)

    handles = [r.register_forward_hook(record(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            for seq in sequences:
                model(input_ids=torch.from_numpy(seq)[None])
    finally:
        for h in handles:
            h.remove()
    return hits


def _sequences(trajs: list[Trajectory]) -> list[np.ndarray]:
    return [np.concatenate([t.prompt_ids, t.response_ids]) for t in trajs]


def _two_ranks_and_one(ray, path, one_config, two_config, shards, steps=1, temperature=0.8):
    """`steps` steps of 1 rank on the union of `shards` and of 2 ranks on them (2 ranks return: no hang,
    TIMEOUT_S bounds every call); the 2 ranks' weights equal the 1 rank's. Returns (initial weights,
    1 rank's weights after, 1 rank's last metrics, 2 ranks' last metrics)."""
    from test_learner_ranks import _assert_same_weights, _train, _weights, learner_group

    with (
        learner_group(ray, 1, path, one_config, temperature) as one,
        learner_group(ray, 2, path, two_config, temperature) as two,
    ):
        initial = _weights(ray, one)
        for _ in range(steps):
            m1 = _train(ray, one, [[t for shard in shards for t in shard]])
            m2 = _train(ray, two, shards)
        w1, w2 = _weights(ray, one), _weights(ray, two)
    _assert_same_weights(w1, w2)
    return initial, w1, m1, m2


def _sharded(zero_stage: int, **kw):
    """The learner config of the 2 ranks: under ZeRO-3 every tensor sharded (no persistent small ones)."""
    from test_learner_ranks import _config

    overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero_stage == 3 else {}
    return _config(zero_stage=zero_stage, deepspeed_overrides=overrides, **kw)


@pytest.mark.parametrize("zero_stage", [3, 2])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_two_ranks_with_uneven_routing_take_the_step_of_one_rank(ray_local, tmp_path, family, zero_stage):
    from test_learner_ranks import _config, _trajectories

    path = build_causal_lm(tmp_path, family, seed=5)
    wide, narrow = _trajectories(6, seed=3), _narrow(4, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    experts = hf.config.num_local_experts if family == "mixtral" else hf.config.num_experts
    narrow_hits, wide_hits = expert_hits(hf, _sequences(narrow)), expert_hits(hf, _sequences(wide))
    assert all(len(h) == hf.config.num_experts_per_tok for h in narrow_hits), (
        narrow_hits
    )  # experts left unused
    assert all(len(h) == experts for h in wide_hits), wide_hits  # the other rank uses every expert

    initial, w1, m1, m2 = _two_ranks_and_one(ray_local, path, _config(), _sharded(zero_stage), [wide, narrow])
    for key in ("params/grad_norm", "loss/policy", "loss/value", "loss/entropy", "objective/kl"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # The experts and the router trained (the unused experts of the narrow rank too, from the wide one).
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.down_proj"):
        assert not torch.equal(w1[name], initial[name]), name


def _replayed_gap(path, trajs, replay: bool, temperature: float) -> float:
    """Mean |proximal - behaviour| logprob over the union's valid tokens, from the learner's own forward
    in this process (`learner.forward.forward_scores`), with or without the recorded routing replayed."""
    from learner.batch import pack_trajectories
    from learner.forward import forward_scores
    from learner.model import PolicyWithValueHead

    b = pack_trajectories(trajs, pad_id=0)
    model = PolicyWithValueHead.from_pretrained(str(path), value_head_std=0.1)
    with torch.no_grad():
        lp = forward_scores(model, b, temperature, replay=replay).logprobs
    valid = b.mask.bool()
    return float((lp - b.tokens.behaviour_logprobs)[valid].abs().mean())


@pytest.mark.parametrize(
    ("mode", "zero_stage"), [("R3", 3), ("R3", 2), ("R2", 3)], ids=["R3-zero3", "R3-zero2", "R2-zero3"]
)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_replay_on_two_ranks_takes_the_step_of_one_rank(
    ray_local, tmp_path, family, mode, zero_stage
):
    """learner.router_replay on real DeepSpeed ranks: one rank holds a noisy hf engine's samples with the
    routing it recorded (every expert used), the other sequences whose recorded routing sends every token
    of every layer to experts {0, 1} (experts 2 and 3 unused there). 2 ranks finish the step and take the
    1-rank step on the union; under R3 the proximal pass is the replayed one (its logprob gap is the
    replayed forward's, not the plain one's); the routers train."""
    from test_learner_ranks import _config
    from test_moe_routing_record import _noisy_engine_samples

    from cluster.records.trajectories import to_trajectory

    path, samples = _noisy_engine_samples(tmp_path, family)
    wide = [to_trajectory(s, s.logprobs, float(i % 3), group=s.prompt_index) for i, s in enumerate(samples)]
    narrow = _narrow(4, seed=4)
    for t in narrow:  # as an engine records it: [p + r - 1, layers, k]
        n = len(t.prompt_ids) + len(t.response_ids) - 1
        t.routing = np.tile(np.array([0, 1], dtype=np.uint8), (n, 2, 1))
    assert {int(e) for s in samples for e in np.unique(s.routing)} == {0, 1, 2, 3}
    temperature = 1.0  # the engine's
    one, two = _config(router_replay=mode), _sharded(zero_stage, router_replay=mode)
    initial, w1, m1, m2 = _two_ranks_and_one(
        ray_local, path, one, two, [wide, narrow], temperature=temperature
    )
    for key in ("params/grad_norm", "loss/policy", "rollout/logprob_gap", "off_policy/behaviour_kl"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    replayed, plain = (_replayed_gap(path, wide + narrow, r, temperature) for r in (True, False))
    assert replayed != pytest.approx(plain, rel=1e-3)
    want = replayed if mode == "R3" else plain  # R2's proximal pass routes itself
    assert m1["rollout/logprob_gap"] == pytest.approx(want, rel=1e-5)
    for layer in (0, 1):  # the routers got gradients through the replayed gate values, and moved
        name = f"model.layers.{layer}.mlp.gate.weight"
        assert not torch.equal(w1[name], initial[name]), name


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_on_the_experts_two_zero3_ranks_take_the_step_of_one_rank(ray_local, tmp_path, family):
    """LoRA on the attention projections and the fused expert stacks (learner.lora.target_parameters),
    uneven routing, 2 ZeRO-3 ranks (every tensor sharded) vs 1 ZeRO-2 rank: the same merged export,
    which differs from the base exactly in the adapted weights."""
    from test_learner_ranks import _config, _trajectories

    from learner.config import LoRAConfig

    path = build_causal_lm(tmp_path, family, seed=5)
    lora = LoRAConfig(
        rank=2,
        alpha=4.0,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    wide, narrow = _trajectories(6, seed=3), _narrow(4, seed=4)
    # two steps: the first moves only B (A's gradient is B^T ...: zero at B = 0)
    base, w1, m1, m2 = _two_ranks_and_one(
        ray_local, path, _config(lora=lora), _sharded(3, lora=lora), [wide, narrow], steps=2
    )
    assert m2["params/grad_norm"] == pytest.approx(m1["params/grad_norm"], rel=1e-5)
    changed = {k for k in base if not torch.equal(base[k], w1[k])}
    adapted = (
        "self_attn.q_proj.weight",
        "self_attn.v_proj.weight",
        "experts.gate_up_proj",
        "experts.down_proj",
    )
    assert changed == {k for k in base if k.endswith(adapted)}
