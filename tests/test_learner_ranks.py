"""Learner ranks as real Ray actors running real DeepSpeed ZeRO engines (gloo on CPU).

The 1-rank vs 2-rank comparison is the check that global-token normalisation and DeepSpeed's own
gradient averaging combine into exactly the gradient of one big batch: Adam's epsilon is set large
so the update is proportional to the gradient (a wrong scale would show in the weights), clipping is
off, and the gradient-norm metric must agree too.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rank_pool import CPUS_PER_RANK, TIMEOUT_S, learner_group  # noqa: F401 - the learner tests import them here
from transformers import AutoModelForCausalLM

from learner.config import KLConfig, LearnerConfig
from learner.model import VALUE_HEAD_FILE
from learner.trajectory import Trajectory

pytestmark = pytest.mark.slow


def _config(**kw) -> LearnerConfig:
    base = dict(
        lr=1e-3,
        adam_eps=1.0,
        max_grad_norm=1e6,
        ppo_epochs=2,
        num_minibatches=1,
        micro_batch_size=2,
        entropy_coef=0.01,
        off_policy="tis",  # its cap: learner.tis.cap, 2.0 by default
        kl=KLConfig(coef=0.1, adaptive=True, target=0.5, horizon=100),
        dist_timeout_s=60,
    )
    base.update(kw)
    return LearnerConfig(**base)


def _trajectories(n: int, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = rng.integers(4, 28, size=int(rng.integers(1, 6)))
        r = rng.integers(4, 28, size=int(rng.integers(1, 8)))
        out.append(
            Trajectory(
                prompt_ids=p,
                response_ids=r,
                behaviour_logprobs=rng.normal(-3.3, 0.2, len(r)).astype(np.float32),
                ref_logprobs=rng.normal(-3.3, 0.2, len(r)).astype(np.float32),
                score=float(rng.normal()),
            )
        )
    return out


def _call(ray, ranks, method: str, *per_rank_args):
    """Call `method` on every rank at once (collectives), with per-rank args when given."""
    if per_rank_args:
        refs = [getattr(r, method).remote(*args) for r, args in zip(ranks, per_rank_args, strict=True)]
    else:
        refs = [getattr(r, method).remote() for r in ranks]
    return ray.get(refs, timeout=TIMEOUT_S)


def _train(ray, ranks, shards) -> dict[str, float]:
    results = _call(ray, ranks, "train_step", *[(s,) for s in shards])
    same = {k: v if v == v else "nan" for k, v in results[0].items()}  # NaN != NaN
    for other in results[1:]:
        assert {k: v if v == v else "nan" for k, v in other.items()} == same, "ranks disagree on the metrics"
    return results[0]


def _weights(ray, ranks) -> dict[str, torch.Tensor]:
    exported = _call(ray, ranks, "export_weights")
    assert all(e is None for e in exported[1:])
    return exported[0]


def _assert_shared_export_is_the_gathered_one(ray, ranks, tmp_path) -> None:
    """Each rank writes its own part (its ZeRO-3 partitions; under ZeRO-2 its share of every tensor) into
    a shared-memory segment (learner.shared_bundle): rank 0's bundle, views of that segment, equals the
    bundle gathered on rank 0, bit for bit, in the training dtype and cast to bf16, ties kept."""
    from learner.shared_bundle import SharedSegment

    def export_into(rank, path: str, dtype: str):  # inside a rank (__ray_call__; nested: shipped by value)
        from learner.shared_bundle import SharedSegment

        return rank.export_weights(None, dtype, False, (SharedSegment(path), 4096))

    segment = SharedSegment.create(str(tmp_path))
    try:
        for dtype in ("float32", "bfloat16"):
            shared = ray.get(
                [r.__ray_call__.remote(export_into, segment.path, dtype) for r in ranks],
                timeout=TIMEOUT_S,
            )
            gathered = _call(ray, ranks, "export_weights", *[(None, dtype, False)] * len(ranks))[0]
            assert all(s is None for s in shared[1:]) and list(shared[0]) == list(gathered)
            for k, t in gathered.items():
                assert shared[0][k].dtype == t.dtype and torch.equal(shared[0][k], t), k
            assert shared[0]["lm_head.weight"] is shared[0]["transformer.wte.weight"]  # tied: one tensor
    finally:
        segment.remove()


def _assert_same_weights(a, b, atol=2e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def _assert_step_skipped(ray, ranks, batch_shards, config: LearnerConfig) -> None:
    """A NaN score on one rank skips every optimizer step of the update on all ranks; training goes on."""
    before = _weights(ray, ranks)
    poisoned = [list(s) for s in batch_shards]
    poisoned[0][0] = Trajectory(**{**vars(poisoned[0][0]), "score": float("nan")})
    m = _train(ray, ranks, poisoned)
    assert m["train/skipped_steps"] == config.ppo_epochs * config.num_minibatches
    assert m["train/optimizer_steps"] == 0 and math.isnan(m["loss/policy"])
    _assert_same_weights(_weights(ray, ranks), before, atol=0)
    m = _train(ray, ranks, batch_shards)
    assert m["train/skipped_steps"] == 0 and math.isfinite(m["params/grad_norm"])
    after = _weights(ray, ranks)
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_zero2_one_rank_and_two_ranks_take_the_same_steps(ray_local, tiny_policy_dir, tmp_path):
    ray = ray_local
    batch1, batch2 = _trajectories(12, seed=1), _trajectories(5, seed=2)
    with (
        learner_group(ray, 1, tiny_policy_dir, _config(micro_batch_size=3)) as one,
        learner_group(ray, 2, tiny_policy_dir, _config(micro_batch_size=2)) as two,
    ):
        initial = _weights(ray, one)
        m1 = _train(ray, one, [batch1])
        m2 = _train(ray, two, [batch1[:7], batch1[7:]])  # uneven shards
        w1, w2 = _weights(ray, one), _weights(ray, two)
        assert not torch.equal(w1["lm_head.weight"], initial["lm_head.weight"])
        _assert_same_weights(w1, w2)
        for key in ("params/grad_norm", "loss/policy", "loss/value", "loss/entropy", "objective/kl"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        assert m1["train/tokens"] == m2["train/tokens"] == sum(len(t.response_ids) for t in batch1)
        assert m1["train/optimizer_steps"] == m2["train/optimizer_steps"] == 2
        # The adaptive controller moved, identically on every rank of both worlds.
        coefs = _call(ray, one, "kl_coef") + _call(ray, two, "kl_coef")
        assert coefs[0] != 0.1 and coefs == [coefs[0]] * 3

        # One rank with an empty shard must neither deadlock nor change the result.
        _train(ray, one, [batch2])
        _train(ray, two, [batch2, []])
        _assert_same_weights(_weights(ray, one), _weights(ray, two))

        _assert_step_skipped(ray, two, [batch1[:7], batch1[7:]], _config())
        _assert_shared_export_is_the_gathered_one(ray, two, tmp_path)


def test_zero3_trains_exports_full_weights_and_restores_checkpoints(ray_local, tiny_policy_dir, tmp_path):
    ray = ray_local
    # 2 optimizer-step slots per PPO step (ppo_epochs=2); warm-up slots 0-1, cosine to 0.1 lr at slot 8
    schedule = dict(lr_schedule="cosine", warmup_steps=2, lr_schedule_steps=8, min_lr_ratio=0.1)
    # Persistence threshold 0: even these tiny tensors are really sharded across the two ranks.
    z3 = _config(
        zero_stage=3,
        deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        **schedule,
    )
    batch1, batch2 = _trajectories(9, seed=3), _trajectories(6, seed=4)
    with (
        learner_group(ray, 1, tiny_policy_dir, _config(**schedule)) as ref,
        learner_group(ray, 2, tiny_policy_dir, z3) as two,
    ):
        _train(ray, ref, [batch1])
        assert _train(ray, two, [batch1[:4], batch1[4:]])["train/lr"] == pytest.approx(1e-3 * 0.5)  # slot 0
        exported = _weights(ray, two)
        _assert_same_weights(exported, _weights(ray, ref))
        # A bundle that leaves the process owns its storage (no view of a shared one: pickled, each view
        # would carry all of it).
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in exported.values())
        # The push's probe is scored on rank 0 from the exported bundle (learner.bundle_probe), not through
        # ZeRO-3's hooks: it equals the training engine's own forward, which gathers every parameter.
        from_bundle = ray.get(two[0].export_fingerprint.remote())["probe"]
        from_engine = _call(ray, two, "_probe_logprobs")[0]
        assert [len(p) for p in from_bundle] == [len(p) for p in from_engine] == [7, 8, 9, 10]
        assert max(float(np.abs(a - b).max()) for a, b in zip(from_bundle, from_engine, strict=True)) <= 1e-5
        _assert_shared_export_is_the_gathered_one(ray, two, tmp_path)

        fresh = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
        fresh.load_state_dict(exported, strict=True)  # full shapes under the HF names
        _call(ray, two, "save_pretrained", *[(str(tmp_path / "hf"),)] * 2)
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
        _assert_same_weights({k: saved[k] for k in exported}, exported, atol=0)
        assert (tmp_path / "hf" / VALUE_HEAD_FILE).exists()

        ckpt = str(tmp_path / "ckpt")
        _call(ray, two, "save_checkpoint", *[(ckpt, {"data_position": 9})] * 2)
        coef_saved = _call(ray, two, "kl_coef")[0]
        m_first = _train(ray, two, [batch2[:2], batch2[2:]])
        w_first = _weights(ray, two)
        assert _call(ray, two, "kl_coef")[0] != coef_saved

        states = _call(ray, two, "load_checkpoint", *[(ckpt,)] * 2)
        assert states == [{"data_position": 9}] * 2
        assert _call(ray, two, "kl_coef") == [coef_saved] * 2
        _assert_same_weights(_weights(ray, two), exported, atol=0)
        # Replaying the step reproduces it only if Adam moments, LR schedule and RNG came back too.
        m_again = _train(ray, two, [batch2[:2], batch2[2:]])
        _assert_same_weights(_weights(ray, two), w_first, atol=1e-7)
        assert m_again["params/grad_norm"] == pytest.approx(m_first["params/grad_norm"], rel=1e-6)
        assert m_again["train/lr"] == m_first["train/lr"] == pytest.approx(1e-3)  # slot 2: the peak

        _assert_step_skipped(ray, two, [batch2[:2], batch2[2:]], z3)  # slots 4-5 skipped, 6-7 taken
        # The skipped slots moved the clock too: slot 8, the floor (slot 6 had 0.1 + 0.9 (1 + cos(2 pi/3)) / 2).
        assert _train(ray, two, [batch2[:2], batch2[2:]])["train/lr"] == pytest.approx(1e-3 * 0.1)


def test_reward_moments_are_global_and_come_back_from_a_checkpoint(ray_local, tiny_policy_dir, tmp_path):
    """reward_norm + relative value clip + value_lr: the running moments are those of all ranks' scores (numpy on
    the concatenation), one rank and two ranks take the same step, and a checkpoint restores them."""
    ray = ray_local
    cfg = _config(reward_norm="standardize", value_clip="relative", value_clip_eps=0.3, value_lr=5e-3)
    batch1, batch2 = _trajectories(9, seed=5), _trajectories(6, seed=6)
    # Scores travel as float32; the moments are float64 over those values.
    s1 = np.array([t.score for t in batch1], dtype=np.float32).astype(np.float64)
    s12 = np.array([t.score for t in batch1 + batch2], dtype=np.float32).astype(np.float64)
    with (
        learner_group(ray, 1, tiny_policy_dir, cfg) as one,
        learner_group(ray, 2, tiny_policy_dir, cfg) as two,
    ):
        m1 = _train(ray, one, [batch1])
        m2 = _train(ray, two, [batch1[:3], batch1[3:]])
        for m in (m1, m2):
            assert m["reward_norm/count"] == 9
            assert m["reward_norm/mean"] == pytest.approx(s1.mean(), rel=1e-12)
            assert m["reward_norm/std"] == pytest.approx(s1.std(ddof=1), rel=1e-12)
            assert m["values/clip_radius"] == pytest.approx(0.3 * m["returns/std"], rel=1e-12)
        assert m2["returns/std"] == pytest.approx(m1["returns/std"], rel=1e-6)
        _assert_same_weights(_weights(ray, one), _weights(ray, two))

        ckpt = str(tmp_path / "ckpt")
        _call(ray, two, "save_checkpoint", *[(ckpt, {})] * 2)
        m_first = _train(ray, two, [batch2[:2], batch2[2:]])
        assert m_first["reward_norm/count"] == 15
        assert m_first["reward_norm/mean"] == pytest.approx(s12.mean(), rel=1e-12)
        assert m_first["reward_norm/std"] == pytest.approx(s12.std(ddof=1), rel=1e-12)
        _call(ray, two, "load_checkpoint", *[(ckpt,)] * 2)
        m_again = _train(ray, two, [batch2[:2], batch2[2:]])  # counted once, not twice: state came back
        for key in ("reward_norm/count", "reward_norm/mean", "reward_norm/std", "loss/value"):
            assert m_again[key] == pytest.approx(m_first[key], rel=1e-9), key


def test_a_composed_rollout_correction_is_the_same_step_on_one_rank_and_two(ray_local, tiny_policy_dir):
    """learner.off_policy 'custom' (token TIS x geometric mask x outlier mask, learner/corrections.py): the
    rejections see whole rows on each rank, the metrics are all-reduced sums, so one rank and two ranks
    (uneven shards) report the same correction and mismatch metrics and take the same step."""
    ray = ray_local
    block = {
        "is_level": "token",
        "is_cap": 1.1,
        "reject": [
            {"level": "geometric", "bounds": [0.85, 1.15]},
            {"level": "outlier", "bounds": [0.5, 2.0]},
        ],
    }
    cfg = _config(off_policy="custom", rollout_correction=block)
    batch = _trajectories(12, seed=7)
    with (
        learner_group(ray, 1, tiny_policy_dir, cfg) as one,
        learner_group(ray, 2, tiny_policy_dir, cfg) as two,
    ):
        m1 = _train(ray, one, [batch])
        m2 = _train(ray, two, [batch[:5], batch[5:]])
        names = ("weight_mean", "weight_max", "truncated_frac", "masked_token_frac", "masked_seq_frac")
        for key in [f"off_policy/{n}" for n in (*names, "behaviour_kl", "behaviour_kl_k1", "ppl_ratio")]:
            assert m2[key] == pytest.approx(m1[key], rel=1e-6, abs=1e-9), key
        assert 0 < m1["off_policy/masked_seq_frac"] < 1 and m1["off_policy/truncated_frac"] > 0
        assert m2["loss/policy"] == pytest.approx(m1["loss/policy"], rel=1e-5, abs=1e-7)
        _assert_same_weights(_weights(ray, one), _weights(ray, two))


def test_three_zero3_ranks_write_their_padded_partitions_into_shared_memory(
    ray_local, tiny_policy_dir, tmp_path
):
    """Over three ranks most tensors do not split evenly (32 elements a row: partitions of 11, the last
    one padded by DeepSpeed): after a step, each rank's partitions land in the shared segment at their
    places and rank 0's bundle is the gathered one."""
    ray = ray_local
    z3 = _config(
        zero_stage=3, deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    )
    batch = _trajectories(6, seed=5)
    with learner_group(ray, 3, tiny_policy_dir, z3) as three:
        _train(ray, three, [batch[:2], batch[2:4], batch[4:]])
        _assert_shared_export_is_the_gathered_one(ray, three, tmp_path)
