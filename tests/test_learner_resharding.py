"""Learner state across a change of rank count, ZeRO stage and optimizer offload (real Ray actors,
real DeepSpeed on gloo).

A consolidated checkpoint written by 2 ZeRO-3 ranks is loaded by 1 ZeRO-2 rank: written back out
from there it must hold bit-identical fp32 weights, Adam moments, step and LR schedule (a round trip
through both DeepSpeed layouts), and the next PPO step must equal the 2-rank continuation (1 and 2
ranks take the same steps: see test_learner_ranks). The reverse direction (1 -> 2) must replay the
step. CPU offload (DeepSpeedCPUAdam) must take the same step as torch AdamW.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_learner_ranks import (
    _assert_same_weights,
    _call,
    _config,
    _train,
    _trajectories,
    _weights,
    learner_group,
)

from learner.consolidated_checkpoint import INDEX

pytestmark = pytest.mark.slow


def _read(ckpt) -> tuple[dict, dict[str, torch.Tensor]]:
    index = json.loads((ckpt / INDEX).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted({e["shard"] for e in index["params"].values()}):
        tensors.update(load_file(ckpt / shard))
    return index, tensors


def _assert_same_checkpoint(a, b) -> None:
    (ia, ta), (ib, tb) = _read(a), _read(b)
    for key in ("optimizer_keys", "optimizer_scalars", "lr", "lr_scheduler", "engine"):
        assert ia[key] == ib[key], key
    shapes = [{n: e["shape"] for n, e in i["params"].items()} for i in (ia, ib)]
    assert shapes[0] == shapes[1]  # (their shards differ: the two were written with other bucket sizes)
    assert ia["optimizer_keys"] == ["exp_avg", "exp_avg_sq"] and ia["optimizer_scalars"]["step"] == 2
    assert ta.keys() == tb.keys() and len(ta) == 3 * len(ia["params"])
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_two_ranks_zero3_checkpoint_resumes_on_one_rank_zero2_and_back(ray_local, tiny_policy_dir, tmp_path):
    ray = ray_local
    z3 = _config(
        zero_stage=3,
        warmup_steps=10,
        deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        export_bucket_mb=0.001,  # many small buckets: the streamed export and checkpoint walk is exercised
    )
    z2 = _config(zero_stage=2, warmup_steps=10)
    batch1, batch2 = _trajectories(9, seed=7), _trajectories(6, seed=8)
    shards1, shards2 = [batch1[:4], batch1[4:]], [batch2[:2], batch2[2:]]
    with (
        learner_group(ray, 2, tiny_policy_dir, z3) as two,
        learner_group(ray, 1, tiny_policy_dir, z2) as one,
    ):
        _train(ray, two, shards1)
        saved = _weights(ray, two)
        ckpt2 = tmp_path / "by_two"
        _call(ray, two, "save_checkpoint", *[(str(ckpt2), {"data_position": 9})] * 2)
        coef = _call(ray, two, "kl_coef")[0]
        assert sorted(p.name for p in ckpt2.iterdir())[0] == "learner_extra.pt"
        assert len(list(ckpt2.glob("shard-*.safetensors"))) > 3  # bounded buckets, not one file

        # 2 -> 1: same weights, optimizer state, schedule, KL controller; written back bit-identically.
        assert _call(ray, one, "load_checkpoint", (str(ckpt2),)) == [{"data_position": 9}]
        assert _call(ray, one, "kl_coef") == [coef]
        _assert_same_weights(_weights(ray, one), saved, atol=0)
        ckpt1 = tmp_path / "by_one"
        _call(ray, one, "save_checkpoint", (str(ckpt1), {"data_position": 9}))
        _assert_same_checkpoint(ckpt2, ckpt1)

        # The next step on 1 rank equals the 2-rank continuation (moments and warm-up LR came back).
        m2 = _train(ray, two, shards2)
        m1 = _train(ray, one, [batch2])
        w2 = _weights(ray, two)
        _assert_same_weights(_weights(ray, one), w2)
        assert m1["params/grad_norm"] == pytest.approx(m2["params/grad_norm"], rel=1e-5)
        assert m1["loss/policy"] == pytest.approx(m2["loss/policy"], rel=1e-5, abs=1e-7)

        # 1 -> 2: the 2 ZeRO-3 ranks load what 1 ZeRO-2 rank wrote and replay the same step.
        assert _call(ray, two, "load_checkpoint", *[(str(ckpt1),)] * 2) == [{"data_position": 9}] * 2
        _assert_same_weights(_weights(ray, two), saved, atol=0)
        _train(ray, two, shards2)
        _assert_same_weights(_weights(ray, two), w2, atol=1e-7)


@pytest.mark.cpu_adam
def test_cpu_offload_takes_the_torch_adamw_step_and_shares_checkpoints(ray_local, tiny_policy_dir, tmp_path):
    """DeepSpeedCPUAdam (offload_optimizer; offload_params too under ZeRO-3) vs torch AdamW."""
    ray = ray_local
    batch1, batch2 = _trajectories(8, seed=9), _trajectories(6, seed=10)
    plain = _config(zero_stage=3, weight_decay=0.01)
    offload = _config(zero_stage=3, weight_decay=0.01, offload_optimizer=True, offload_params=True)
    with (
        learner_group(ray, 1, tiny_policy_dir, plain) as ref,
        learner_group(ray, 1, tiny_policy_dir, offload) as off,
    ):
        engines = _call(ray, off, "optimizer_name")
        assert engines == ["DeepSpeedCPUAdam"] and _call(ray, ref, "optimizer_name") == ["AdamW"]
        m_ref, m_off = _train(ray, ref, [batch1]), _train(ray, off, [batch1])
        for key in ("loss/policy", "loss/value", "params/grad_norm"):
            assert m_off[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-7), key
        _assert_same_weights(_weights(ray, off), _weights(ray, ref), atol=1e-6)

        # An offloaded learner's checkpoint resumes a plain one (and the step matches again).
        ckpt = tmp_path / "offloaded"
        _call(ray, off, "save_checkpoint", (str(ckpt), {}))
        _train(ray, ref, [batch2])  # move the reference away, then bring it back from the checkpoint
        _call(ray, ref, "load_checkpoint", (str(ckpt),))
        _train(ray, ref, [batch2])
        _train(ray, off, [batch2])
        _assert_same_weights(_weights(ray, off), _weights(ray, ref), atol=1e-6)
