"""learner.bypass: a step whose engines provably hold the learner's weights skips the proximal pass.

The rule on one rank (pure), the equality it rests on (a bypassed step's gradients are the recomputed
step's when the behaviour logprobs are the policy's own, and differ when they are not), and a real run:
the sync GRPO demo bypasses every step but the checks, where the gap is measured; a bf16 engine or the
'always' setting never bypasses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from demo_run import CONFIG, demo_overrides, train_rows
from test_learner_packing import GradientTap

from learner.batch import pack_trajectories
from learner.bypass import GAP_LIMIT, ProximalBypass, static_reason
from learner.config import LearnerConfig
from learner.trajectory import Trajectory

VOCAB = 28  # tests/tiny_models' word-level tokenizer


def _all(flags: list[bool]):
    """`all_ranks` over ranks whose local flags are `flags` (this rank's is asked; the others' given)."""
    return lambda here: here and all(flags)


def test_a_step_bypasses_only_where_every_condition_holds():
    grpo = LearnerConfig(advantage="grpo", proximal_check_every=3)
    b = ProximalBypass(grpo)
    steps = [b.decide([4, 4], 4, _all([True])) for _ in range(7)]
    assert steps == [False, True, True, False, True, True, False]  # the first and every 3rd check
    b = ProximalBypass(grpo)
    b.decide([], 4, _all([True]))  # the check
    assert b.decide([], 4, _all([True]))  # an empty shard holds nothing against it
    assert not b.decide([4, 3], 4, _all([True]))  # a sample of v3: not the engines' current weights
    assert not b.decide([4], None, _all([True]))  # the driver does not vouch (async, bf16 engine, ...)
    assert not b.decide([0], 0, _all([True]))  # v0 was read from disk, never checked against the learner
    assert not b.decide([4], 4, _all([False]))  # another rank holds an older sample
    for config, reason in [
        (LearnerConfig(advantage="gae"), "learns values"),
        (LearnerConfig(advantage="grpo", proximal_pass="always"), "proximal_pass='always'"),
        (LearnerConfig(advantage="grpo", reference_from_base=True, lora={"rank": 4}), "reference_from_base"),
        (LearnerConfig(advantage="grpo", off_policy="tis"), "off_policy='tis'"),
    ]:
        assert reason in static_reason(config)
        b = ProximalBypass(config)
        assert not any(b.decide([4], 4, _all([True])) for _ in range(3))
    assert static_reason(grpo) is None


def test_a_measured_gap_over_the_limit_ends_the_bypass(capsys):
    b = ProximalBypass(LearnerConfig(advantage="grpo", proximal_check_every=2))
    assert not b.decide([2], 2, _all([True]))
    assert b.record({"rollout/logprob_gap": GAP_LIMIT / 10}, False) == {
        "train/proximal_bypassed": 0.0,
        "train/proximal_bypass_off": 0.0,
    }
    assert b.decide([2], 2, _all([True]))
    assert b.record({"rollout/logprob_gap": math.nan}, True)["train/proximal_bypassed"] == 1.0
    assert not b.decide([2], 2, _all([True]))  # the check
    assert b.record({"rollout/logprob_gap": 3e-3}, False)["train/proximal_bypass_off"] == 1.0
    assert "differ from the learner's by 3.00e-03 nats per token" in capsys.readouterr().out
    assert not any(b.decide([2], 2, _all([True])) for _ in range(4))


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    from tiny_models import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("bypass_lm"), "gpt2", seed=5)


def _trajectories(seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(6):
        r = 2 + i % 4
        out.append(
            Trajectory(
                rng.integers(4, VOCAB, size=3),
                rng.integers(4, VOCAB, size=r),
                rng.normal(-3.3, 0.2, r).astype(np.float32),
                rng.normal(-3.3, 0.2, r).astype(np.float32),
                float(i % 3 == 0),
                policy_version=2,
                group=i // 2,
            )
        )
    return out


def _step(path, trajs, bypass: bool):
    from learner.context import LearnerContext
    from learner.model import PolicyWithValueHead
    from learner.ppo_step import ppo_update
    from learner.prepare import prepare

    torch.manual_seed(0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(path), step_applied=True)
    config = LearnerConfig(advantage="grpo", ppo_epochs=2, num_minibatches=2, micro_batch_size=2)
    batch = pack_trajectories(trajs, pad_id=0)
    stats = prepare(LearnerContext(tap, config, 1.0, 0), batch, 0.1, bypass)
    stats.update(ppo_update(LearnerContext(tap, config, 1.0, 0, torch.Generator().manual_seed(3)), batch))
    return tap.grads, stats, batch


def test_a_bypassed_step_is_the_recomputed_step_when_the_engine_held_the_weights(policy_path):
    """Behaviour logprobs that are the policy's own (as an engine holding its weights returns them, here
    the proximal pass's own numbers): skipping the pass changes no gradient, advantage or loss. With
    behaviour logprobs of another policy it does: the PPO ratio starts away from 1."""
    trajs = _trajectories()
    _, _, probed = _step(policy_path, trajs, bypass=False)
    own = [
        Trajectory(
            t.prompt_ids,
            t.response_ids,
            probed.tokens.old_logprobs[i, : len(t.response_ids)].numpy().copy(),
            t.ref_logprobs,
            t.score,
            policy_version=t.policy_version,
            group=t.group,
        )
        for i, t in enumerate(trajs)
    ]
    grads_a, stats_a, batch_a = _step(policy_path, own, bypass=False)
    grads_b, stats_b, batch_b = _step(policy_path, own, bypass=True)
    assert stats_a["rollout/logprob_gap"] == 0.0 and math.isnan(stats_b["rollout/logprob_gap"])
    valid = batch_a.mask.bool()  # (the pass also scores pad positions, which no loss reads)
    assert torch.equal(batch_a.tokens.old_logprobs[valid], batch_b.tokens.old_logprobs[valid])
    assert torch.allclose(batch_a.tokens.advantages, batch_b.tokens.advantages)
    for key in ("loss/policy", "objective/kl", "params/approx_kl", "params/policy_clip_frac"):
        assert stats_a[key] == pytest.approx(stats_b[key], abs=1e-7), key
    assert len(grads_a) == len(grads_b) == 4
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert all(torch.allclose(ga[n], gb[n], atol=1e-7) for n in ga)
    grads_c, stats_c, _ = _step(policy_path, trajs, bypass=True)  # someone else's logprobs
    assert stats_c["params/approx_kl"] > 1e-3
    assert not all(torch.allclose(grads_a[0][n], grads_c[0][n], atol=1e-5) for n in grads_a[0])


@pytest.mark.slow
def test_the_sync_grpo_demo_bypasses_all_but_the_checks_and_measures_the_gap_there(
    ray_local, demo_assets, tmp_path
):
    """Real Ray, the colocated demo with GRPO: step 1 (v0 from disk) and every 3rd step run the proximal
    pass and measure the gap (float32 engine: under the limit); the others bypass it. A bfloat16 engine
    (other numerics) never bypasses, nor does learner.proximal_pass='always'."""
    from cluster.config.schema import load_config

    grpo = {
        "cluster.placement": "colocated",
        "learner.advantage": "grpo",
        "rollout.sampling.n": 2,
        "data.prompts_per_step": 8,
        "rollout.chunk_size": 16,
        "learner.micro_batch_size": 8,
        "learner.proximal_check_every": 3,
    }
    rows = train_rows(load_config(CONFIG, demo_overrides(demo_assets, 5, **grpo)), tmp_path / "auto", 5)
    assert [r["train/proximal_bypassed"] for r in rows] == [0.0, 1.0, 1.0, 0.0, 1.0]
    gaps = [r["rollout/logprob_gap"] for r in rows]
    assert all(g < GAP_LIMIT for g in (gaps[0], gaps[3])) and all(math.isnan(gaps[i]) for i in (1, 2, 4))
    assert all(r["train/proximal_bypass_off"] == 0.0 and math.isfinite(r["loss/policy"]) for r in rows)
    for name, extra in [
        ("bf16", {"rollout.dtype": "bfloat16"}),
        ("always", {"learner.proximal_pass": "always"}),
    ]:
        cfg = load_config(CONFIG, demo_overrides(demo_assets, 3, **grpo, **extra))
        rows = train_rows(cfg, tmp_path / name, 3)
        assert [r["train/proximal_bypassed"] for r in rows] == [0.0, 0.0, 0.0], name
        assert all(math.isfinite(r["rollout/logprob_gap"]) for r in rows), name
