"""The estimators and policy losses inside real DeepSpeed learner ranks: one rank and two ranks (groups
whole on each) take the same steps (GSPO and Dr. GRPO included, whose aggregations divide by the global
sequence count); critic-free estimators leave the value head alone and give it no optimizer state."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_learner_ranks import _assert_same_weights, _config, _train, _trajectories, _weights, learner_group

from cluster.records.groups import group_runs, shard_by_group
from learner.config import KLConfig
from learner.deepspeed_setup import build_optimizer
from learner.model import PolicyWithValueHead

pytestmark = pytest.mark.slow


def _grouped(n_groups: int, n: int, seed: int):
    """n samples per prompt (same prompt ids within a group); every third one truncated."""
    base = _trajectories(n_groups * n, seed)
    out = []
    for i, t in enumerate(base):
        prompt = base[(i // n) * n].prompt_ids
        out.append(dataclasses.replace(t, prompt_ids=prompt, group=i // n, truncated=i % 3 == 0))
    return out


# The two-rank world of the last case runs ZeRO-3 with every tensor sharded (frozen value head included).
ZERO3 = {
    "zero_stage": 3,
    "deepspeed_overrides": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
}


@pytest.mark.parametrize(
    "overrides,two_ranks",
    [
        (  # GSPO's sequence ratio, with the KL as a loss term (learner.registry: one registered loss)
            {
                "advantage": "grpo",
                "policy_loss": "gspo",
                "loss_agg": "seq-mean-token-mean",
                "kl": KLConfig(mode="loss", loss_coef=0.05),
            },
            {},
        ),
        ({"advantage": "rloo", "missing_eos_penalty": 1.0}, {}),
        (
            {
                "advantage": "vtrace",
                "off_policy": "none",
                "truncation": "bootstrap",
                "vtrace": {"rho_clip": 2.0},
            },
            {},
        ),
        (  # Dr. GRPO: no std, each sequence's token sum over a constant (two ranks: global sequence count)
            {
                "advantage": "grpo",
                "grpo": {"norm_adv_by_std": False},
                "loss_agg": "seq-mean-token-sum-norm",
                "loss_norm_tokens": 16,
            },
            ZERO3,
        ),
    ],
    ids=["gspo-kl-loss", "rloo-eos-penalty", "vtrace-bootstrap", "dr-grpo-zero3"],
)
def test_one_rank_and_two_ranks_agree(ray_local, tiny_policy_dir, overrides, two_ranks):
    ray = ray_local
    batch = _grouped(4, 3, seed=3)  # 4 prompts x 3 samples
    shards = shard_by_group(group_runs([t.group for t in batch]), 2)
    assert [len(s) for s in shards] == [6, 6]
    uneven = [batch[:9], batch[9:]]  # 3 groups and 1 group: still whole
    with (
        learner_group(ray, 1, tiny_policy_dir, _config(micro_batch_size=4, **overrides)) as one,
        learner_group(ray, 2, tiny_policy_dir, _config(micro_batch_size=2, **overrides, **two_ranks)) as two,
    ):
        initial = _weights(ray, one)
        m1 = _train(ray, one, [batch])
        m2 = _train(ray, two, uneven)
        _assert_same_weights(_weights(ray, one), _weights(ray, two))
        assert not torch.equal(_weights(ray, one)["lm_head.weight"], initial["lm_head.weight"])
        for key in ("params/grad_norm", "loss/policy", "loss/value", "advantages/mean", "returns/mean"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        if overrides["advantage"] in ("grpo", "rloo"):
            assert m1["loss/value"] == 0.0 and m1["values/mean"] == 0.0
        else:
            assert m1["loss/value"] > 0.0


def test_frozen_value_head_has_no_optimizer_state(tiny_policy_dir):
    model = PolicyWithValueHead.from_pretrained(tiny_policy_dir)
    model.value_head.requires_grad_(False)
    opt = build_optimizer(model, _config(advantage="grpo"))
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in held for p in model.value_head.parameters())
    assert sum(p.numel() for p in model.parameters() if id(p) in held) == sum(
        p.numel() for p in model.policy.parameters()
    )
