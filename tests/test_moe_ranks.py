"""Mixture-of-experts policies on real DeepSpeed learner ranks (gloo on CPU): 2 ranks whose data route
unevenly (one rank's micro-batches leave experts of every layer unused) finish the step and take the
step one rank takes on the union, under ZeRO-3 (every tensor sharded) and ZeRO-2.

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


@pytest.mark.parametrize("zero_stage", [3, 2])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_two_ranks_with_uneven_routing_take_the_step_of_one_rank(ray_local, tmp_path, family, zero_stage):
    from test_learner_ranks import (
        _assert_same_weights,
        _config,
        _train,
        _trajectories,
        _weights,
        learner_group,
    )

    ray = ray_local
    path = build_causal_lm(tmp_path, family, seed=5)
    wide, narrow = _trajectories(6, seed=3), _narrow(4, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    experts = hf.config.num_local_experts if family == "mixtral" else hf.config.num_experts
    narrow_hits, wide_hits = expert_hits(hf, _sequences(narrow)), expert_hits(hf, _sequences(wide))
    assert all(len(h) == hf.config.num_experts_per_tok for h in narrow_hits), (
        narrow_hits
    )  # experts left unused
    assert all(len(h) == experts for h in wide_hits), wide_hits  # the other rank uses every expert

    overrides = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if zero_stage == 3 else {}
    sharded = _config(zero_stage=zero_stage, deepspeed_overrides=overrides)
    with (
        learner_group(ray, 1, path, _config()) as one,
        learner_group(ray, 2, path, sharded) as two,
    ):
        initial = _weights(ray, one)
        m1 = _train(ray, one, [wide + narrow])
        m2 = _train(ray, two, [wide, narrow])  # returns (no hang: TIMEOUT_S bounds every call)
        w1, w2 = _weights(ray, one), _weights(ray, two)
        _assert_same_weights(w1, w2)
        for key in ("params/grad_norm", "loss/policy", "loss/value", "loss/entropy", "objective/kl"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        # The experts and the router trained (the unused experts of the narrow rank too, from the wide one).
        for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.down_proj"):
            assert not torch.equal(w1[name], initial[name]), name


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lora_on_the_experts_two_zero3_ranks_take_the_step_of_one_rank(ray_local, tmp_path, family):
    """LoRA on the attention projections and the fused expert stacks (learner.lora.target_parameters),
    uneven routing, 2 ZeRO-3 ranks (every tensor sharded) vs 1 ZeRO-2 rank: the same merged export,
    which differs from the base exactly in the adapted weights."""
    from test_learner_ranks import (
        _assert_same_weights,
        _config,
        _train,
        _trajectories,
        _weights,
        learner_group,
    )

    from learner.config import LoRAConfig

    ray = ray_local
    path = build_causal_lm(tmp_path, family, seed=5)
    lora = LoRAConfig(
        rank=2,
        alpha=4.0,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    z3 = _config(
        zero_stage=3,
        lora=lora,
        deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    wide, narrow = _trajectories(6, seed=3), _narrow(4, seed=4)
    with (
        learner_group(ray, 1, path, _config(lora=lora)) as one,
        learner_group(ray, 2, path, z3) as two,
    ):
        base = _weights(ray, one)
        for _ in range(2):  # the first step moves only B (A's gradient is B^T ...: zero at B = 0)
            m1 = _train(ray, one, [wide + narrow])
            m2 = _train(ray, two, [wide, narrow])
        w1, w2 = _weights(ray, one), _weights(ray, two)
        _assert_same_weights(w1, w2)
        assert m2["params/grad_norm"] == pytest.approx(m1["params/grad_norm"], rel=1e-5)
        changed = {k for k in base if not torch.equal(base[k], w1[k])}
        adapted = (
            "self_attn.q_proj.weight",
            "self_attn.v_proj.weight",
            "experts.gate_up_proj",
            "experts.down_proj",
        )
        assert changed == {k for k in base if k.endswith(adapted)}
