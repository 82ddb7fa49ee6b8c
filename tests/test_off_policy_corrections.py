"""The rollout-correction family (learner/corrections.py): each IS level and rejection with numbers worked
by hand, their compositions, the mismatch metrics, the config's errors, the explicit bypass mode, and a
learner step (prepare + the PPO update on a tiny real model) under each new mode. verl's formulas as a
reference: tests/test_off_policy_verl.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from learner.bypass import ProximalBypass
from learner.config import LearnerConfig
from learner.corrections import Correction, Reject, correction_weights, from_config

# The shared case. rho = pi_prox / mu: row 0 [2, 1, 3]; row 1 [0.25, 1] then a padded position.
# Row 0: prod rho = 6, geometric mean 6^(1/3) = 1.8171; row 1: prod 0.25, geometric mean 0.5.
PROX = torch.log(torch.tensor([[1.0, 0.5, 0.9], [0.1, 0.4, 0.7]]))
MU = torch.log(torch.tensor([[0.5, 0.5, 0.3], [0.4, 0.4, 0.2]]))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _c(is_level="none", is_cap=2.0, *rejects):
    """A correction: (level, (lo, hi)) pairs for the rejections."""
    return Correction(is_level, is_cap, tuple(Reject(level, bounds) for level, bounds in rejects))


def _run(is_level="none", is_cap=2.0, *rejects):
    w, sums, mx = correction_weights(PROX, MU, MASK, _c(is_level, is_cap, *rejects))
    return w, sums.metrics(mx)


def test_token_tis_truncates_each_ratio_at_the_cap():
    # min(rho, 2.5): [2, 1, 2.5] and [0.25, 1]; one token (rho 3) truncated of 5.
    w, m = _run("token", 2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 2.5], [0.25, 1.0, 0.0]]))
    assert m["off_policy/truncated_frac"] == pytest.approx(1 / 5)
    assert m["off_policy/masked_token_frac"] == 0.0
    assert m["off_policy/weight_mean"] == pytest.approx(6.75 / 5)


def test_sequence_tis_truncates_the_product_of_the_ratios():
    # Row 0: min(2*1*3, 2.5) = 2.5 on its 3 tokens (truncated); row 1: min(0.25*1, 2.5) = 0.25 on its 2.
    w, m = _run("sequence", 2.5)
    assert torch.allclose(w, torch.tensor([[2.5, 2.5, 2.5], [0.25, 0.25, 0.0]]))
    assert m["off_policy/truncated_frac"] == pytest.approx(3 / 5)
    assert m["off_policy/weight_max"] == pytest.approx(2.5)
    # a cap above 6 keeps the whole product: 6 on row 0
    w, _ = _run("sequence", 10.0)
    assert torch.allclose(w[0], torch.full((3,), 6.0))


def test_sequence_tis_is_computed_in_log_space():
    """400 tokens of rho = e each: the product e^400 overflows float32, its log (400) does not; the cap
    (e^1 here) applies in log space."""
    prox, mu, mask = torch.zeros(1, 400), torch.full((1, 400), -1.0), torch.ones(1, 400)
    w, sums, _ = correction_weights(prox, mu, mask, Correction(is_level="sequence", is_cap=math.e))
    assert torch.allclose(w, torch.full((1, 400), math.e))
    assert sums.truncated == 400.0


def test_token_rejection_is_two_sided():
    # keep rho in [0.5, 2.5]: 2 yes, 1 yes, 3 no (above), 0.25 no (below), 1 yes.
    w, m = _run("none", 2.0, ("token", (0.5, 2.5)))
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    assert m["off_policy/masked_token_frac"] == pytest.approx(2 / 5)
    assert m["off_policy/masked_seq_frac"] == pytest.approx(2 / 2)  # each row lost a token
    assert m["off_policy/truncated_frac"] == 0.0
    # lo = 0: one-sided, the old 'mask' preset: only the 3 goes
    w, _ = _run("none", 2.0, ("token", (0.0, 2.5)))
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))


def test_sequence_rejection_reads_the_product():
    # keep prod rho in [0.2, 5]: row 0 (6) rejected, row 1 (0.25) kept.
    w, m = _run("none", 2.0, ("sequence", (0.2, 5.0)))
    assert torch.equal(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["off_policy/masked_token_frac"] == pytest.approx(3 / 5)
    assert m["off_policy/masked_seq_frac"] == pytest.approx(1 / 2)
    # [0.3, 10]: row 1's 0.25 is now below
    w, _ = _run("none", 2.0, ("sequence", (0.3, 10.0)))
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_geometric_rejection_reads_the_geometric_mean():
    # [0.6, 2]: row 0 (1.817) kept, row 1 (0.5) below; [0.5, 1.5]: row 0 above, row 1 kept (0.5 >= 0.5).
    w, m = _run("none", 2.0, ("geometric", (0.6, 2.0)))
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert m["off_policy/masked_seq_frac"] == pytest.approx(1 / 2)
    w, _ = _run("none", 2.0, ("geometric", (0.5, 1.5)))
    assert torch.equal(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_icepop_keeps_the_ratio_inside_the_band_and_zero_outside():
    # M(rho) = rho on [0.5, 2.5], else 0: [2, 1, 0] and [0, 1]. The kept tokens carry rho, not 1.
    w, m = _run("none", 2.0, ("icepop", (0.5, 2.5)))
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    assert m["off_policy/masked_token_frac"] == pytest.approx(2 / 5)
    assert m["off_policy/weight_mean"] == pytest.approx(4 / 5)
    # = token TIS with a cap >= hi times the two-sided token mask
    tis, _ = _run("token", 2.5)
    mask, _ = _run("none", 2.0, ("token", (0.5, 2.5)))
    assert torch.allclose(w, tis * mask)


def test_token_tis_composes_with_the_geometric_mask():
    # min(rho, 1.5) x 1[geo in [0.6, 2]]: row 0 [1.5, 1, 1.5] (two truncated), row 1 rejected (two masked).
    w, m = _run("token", 1.5, ("geometric", (0.6, 2.0)))
    assert torch.allclose(w, torch.tensor([[1.5, 1.0, 1.5], [0.0, 0.0, 0.0]]))
    assert m["off_policy/weight_mean"] == pytest.approx(4 / 5)
    assert m["off_policy/truncated_frac"] == pytest.approx(2 / 5)
    assert m["off_policy/masked_token_frac"] == pytest.approx(2 / 5)
    assert m["off_policy/clipped_frac"] == pytest.approx(4 / 5)  # truncated or masked
    assert m["off_policy/masked_seq_frac"] == pytest.approx(1 / 2)


def test_the_outlier_mask_drops_a_row_with_any_token_outside():
    # [0.2, 2.5]: row 0 has rho 3 (above) -> dropped; row 1's 0.25 and 1 are inside -> kept.
    w, m = _run("none", 2.0, ("outlier", (0.2, 2.5)))
    assert torch.equal(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert m["off_policy/masked_seq_frac"] == pytest.approx(1 / 2)
    # the padded position (read as rho 1 where it is NaN) never drops its row
    w, _ = _run("none", 2.0, ("outlier", (0.2, 3.0)))
    assert torch.equal(w, MASK)


def test_rejections_stack_a_token_is_kept_when_every_one_keeps_it():
    """SkyRL's order: geometric [0.5, 2] keeps both rows (1.817, 0.5); token TIS C = 2 gives [2, 1, 2]
    and [0.25, 1]; the token mask [0.5, 2.5] drops 3 and 0.25; the outlier mask [0.2, 2.5] drops row 0
    (its 3). Result: row 0 all 0, row 1 [0, 1]; 4 of 5 tokens and both rows rejected."""
    w, m = _run("token", 2.0, ("geometric", (0.5, 2.0)), ("token", (0.5, 2.5)), ("outlier", (0.2, 2.5)))
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert m["off_policy/masked_token_frac"] == pytest.approx(4 / 5)
    assert m["off_policy/masked_seq_frac"] == 1.0
    assert m["off_policy/truncated_frac"] == pytest.approx(1 / 5)  # the 3, truncated (and then rejected)
    assert m["off_policy/clipped_frac"] == pytest.approx(4 / 5)


def test_mismatch_metrics_by_hand():
    """k1 = mean_t (log mu - log pi_prox) = -(ln 2 + 0 + ln 3 + ln 0.25 + 0)/5 = -ln(1.5)/5 = -0.081093;
    k3 = mean_t (rho - 1 - ln rho) = (1 - ln 2 + 0 + 2 - ln 3 + ln 4 - 0.75 + 0)/5 = 1.844530/5 = 0.368906;
    ppl ratio = mean_i exp(mean_t (log mu - log pi_prox)) = (6^(-1/3) + 0.25^(-1/2))/2 = (0.550321 + 2)/2."""
    _, m = _run()
    assert m["off_policy/behaviour_kl_k1"] == pytest.approx(-math.log(1.5) / 5, rel=1e-5)
    assert m["off_policy/behaviour_kl"] == pytest.approx(0.368906, rel=1e-5)
    assert m["off_policy/ppl_ratio"] == pytest.approx((6 ** (-1 / 3) + 2.0) / 2, rel=1e-5)
    for k in ("truncated_frac", "masked_token_frac", "masked_seq_frac", "clipped_frac"):
        assert m[f"off_policy/{k}"] == 0.0


def test_padding_is_never_read():
    prox, mu = PROX.clone(), MU.clone()
    prox[1, 2], mu[1, 2] = float("nan"), float("inf")
    for c in (
        _c("sequence", 2.0, ("geometric", (0.4, 2.0))),
        _c("none", 2.0, ("icepop", (0.5, 5.0))),
        _c("token", 2.0, ("sequence", (0.1, 10.0)), ("outlier", (0.2, 2.5))),
    ):
        w1, s1, mx1 = correction_weights(prox, mu, MASK, c)
        w2, s2, mx2 = correction_weights(PROX, MU, MASK, c)
        assert torch.equal(w1, w2) and s1 == s2 and mx1 == mx2


LEVELS = ["token", "sequence", "geometric", "outlier", "icepop"]


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["none", "token", "sequence"]),
    st.floats(0.1, 5.0),
    st.lists(st.tuples(st.sampled_from(LEVELS[:4]), st.floats(0.0, 1.0), st.floats(1.0, 10.0)), max_size=3),
    st.integers(0, 2**31),
)
def test_no_mismatch_means_no_correction(is_level, cap, rejects, seed):
    """mu = pi_prox: rho = 1 on every token, inside every [lo, hi] (lo <= 1 <= hi), so no rejection fires
    and every weight is min(1, C) (1 for the usual C >= 1); the mismatch metrics read 0 (ppl ratio 1)."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand((4, 6), generator=g) * 5
    mask = (torch.arange(6) < torch.randint(1, 7, (4, 1), generator=g)).float()
    c = _c(is_level, cap, *[(level, (lo, hi)) for level, lo, hi in rejects])
    w, sums, _ = correction_weights(lp, lp.clone(), mask, c)
    assert torch.allclose(w, mask * (min(1.0, cap) if is_level != "none" else 1.0))
    m = sums.metrics(0.0)
    assert m["off_policy/masked_token_frac"] == 0.0 and m["off_policy/masked_seq_frac"] == 0.0
    assert m["off_policy/behaviour_kl"] == 0.0 and m["off_policy/behaviour_kl_k1"] == 0.0
    assert m["off_policy/ppl_ratio"] == pytest.approx(1.0)


# ----- the config -----
def test_presets_map_onto_the_composed_correction():
    assert from_config(LearnerConfig(off_policy="tis", tis={"cap": 3.0})) == Correction("token", 3.0)
    assert from_config(LearnerConfig(off_policy="mask", mask={"cap": 3.0})) == _c(
        "none", 2.0, ("token", (0.0, 3.0))
    )
    geo = LearnerConfig(off_policy="geo_mask", geo_mask={"bounds": (0.7, 1.4)})
    assert from_config(geo) == _c("none", 2.0, ("geometric", (0.7, 1.4)))
    assert from_config(LearnerConfig(off_policy="auto")) == from_config(LearnerConfig(off_policy="none"))
    block = {
        "is_level": "token",
        "is_cap": 1.5,
        "reject": [
            {"level": "geometric", "bounds": [0.8, 1.25]},
            {"level": "outlier", "bounds": [1e-4, 100]},
        ],
    }
    cfg = LearnerConfig(off_policy="custom", rollout_correction=block)
    assert from_config(cfg) == _c("token", 1.5, ("geometric", (0.8, 1.25)), ("outlier", (1e-4, 100.0)))


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            {
                "off_policy": "custom",
                "rollout_correction": {"reject": [{"level": "product", "bounds": [0.5, 2]}]},
            },
            ["rollout_correction.reject.0.level", "'token', 'sequence', 'geometric', 'outlier' or 'icepop'"],
        ),
        (
            {"off_policy": "custom", "rollout_correction": {"is_level": "seq"}},
            ["rollout_correction.is_level", "'none', 'token' or 'sequence'"],
        ),
        ({"off_policy": "custom"}, ["off_policy='custom' needs learner.rollout_correction"]),
        ({"off_policy": "tis", "rollout_correction": {}}, ["only with learner.off_policy: custom", "'tis'"]),
        (
            {
                "off_policy": "custom",
                "rollout_correction": {
                    "is_level": "token",
                    "reject": [{"level": "icepop", "bounds": [0.5, 5]}],
                },
            },
            ["'icepop' rejection", "is_level must be 'none'"],
        ),
        (
            {
                "off_policy": "custom",
                "rollout_correction": {"reject": [{"level": "token", "bounds": [1.2, 2.0]}]},
            },
            ["reject bounds must satisfy 0 <= lo <= 1 <= hi"],
        ),
        ({"proximal_pass": "never"}, ["proximal_pass", "'auto', 'always' or 'bypass'"]),
        ({"proximal_pass": "bypass", "advantage": "gae"}, ["proximal_pass='bypass'", "critic"]),
        (
            {"proximal_pass": "bypass", "advantage": "grpo", "off_policy": "tis"},
            ["proximal_pass='bypass'", "off_policy 'auto' or 'none'"],
        ),
    ],
)
def test_a_wrong_value_names_the_field_and_the_allowed_values(kw, words):
    with pytest.raises(ValidationError) as e:
        LearnerConfig(**kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_every_is_level_and_rejection_is_a_registered_two_argument_function_listed_in_the_reference():
    import inspect
    from pathlib import Path

    from learner.registry import ROLLOUT_IS, ROLLOUT_REJECT

    doc = (Path(__file__).resolve().parent.parent / "docs" / "config-reference.md").read_text()
    for registry in (ROLLOUT_IS, ROLLOUT_REJECT):
        for part in registry:
            fn = registry.function(part.name)
            assert len(inspect.signature(fn).parameters) == 2 and fn.__doc__, part.name
            assert f"'{part.name}': {part.summary}".replace("|", "\\|") in doc, part.name


def test_the_explicit_bypass_mode_bypasses_every_step_without_the_engines_word():
    b = ProximalBypass(LearnerConfig(advantage="grpo", proximal_pass="bypass", proximal_check_every=2))
    assert b.never is None
    assert all(b.decide([1], None, lambda ok: ok) for _ in range(5))  # no check steps, no digest needed


# ----- a learner step under each new mode -----
VOCAB = 28  # tests/tiny_models' word-level tokenizer


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    from tiny_models import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("corrections_lm"), "gpt2", seed=5)


def _trajectories(path):
    """Six samples whose behaviour logprobs are the tiny policy's own plus N(0, 0.3) noise per token: an
    engine with other numerics, a mismatch of the size the corrections are for."""
    from learner.trajectory import Trajectory

    rng = np.random.default_rng(1)
    trajs = [
        Trajectory(
            rng.integers(4, VOCAB, size=3),
            rng.integers(4, VOCAB, size=2 + i % 4),
            np.zeros(2 + i % 4, np.float32),
            rng.normal(-3.3, 0.2, 2 + i % 4).astype(np.float32),
            float(i % 3 == 0),
            group=i // 2,
        )
        for i in range(6)
    ]
    _, _, probed, _ = _step(path, trajs)  # the proximal pass's logprobs: the policy's own
    for i, t in enumerate(trajs):
        own = probed.tokens.old_logprobs[i, : len(t.response_ids)].numpy()
        t.behaviour_logprobs = (own + rng.normal(0.0, 0.3, len(own))).astype(np.float32)
    return trajs


def _step(path, trajs, bypass=False, **kw):
    from test_learner_packing import GradientTap

    from learner.batch import pack_trajectories
    from learner.context import LearnerContext
    from learner.model import PolicyWithValueHead
    from learner.ppo_step import ppo_update
    from learner.prepare import prepare

    torch.manual_seed(0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(path), step_applied=True)
    config = LearnerConfig(advantage="grpo", ppo_epochs=1, num_minibatches=1, micro_batch_size=6, **kw)
    batch = pack_trajectories(trajs, pad_id=0)
    stats = prepare(LearnerContext(tap, config, 1.0, 0), batch, 0.0, bypass)
    weights = batch.tokens.is_weights
    stats.update(ppo_update(LearnerContext(tap, config, 1.0, 0, torch.Generator().manual_seed(3)), batch))
    return tap.grads, stats, batch, weights


@pytest.fixture(scope="module")
def trajs(policy_path):
    return _trajectories(policy_path)


MODES = {  # bounds tight enough that each truncates or rejects some of the noisy tokens
    "seq_tis+seq_mask": {
        "is_level": "sequence",
        "is_cap": 1.2,
        "reject": [{"level": "sequence", "bounds": [0.6, 1.6]}],
    },
    "token_tis+geo+outlier": {
        "is_level": "token",
        "is_cap": 1.2,
        "reject": [{"level": "geometric", "bounds": [0.9, 1.1]}, {"level": "outlier", "bounds": [0.3, 3.0]}],
    },
    "icepop": {"reject": [{"level": "icepop", "bounds": [0.8, 1.25]}]},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_learner_step_runs_under_each_new_mode(policy_path, trajs, mode):
    """prepare + the PPO update on a tiny GPT-2: the weights the loss reads are the correction's of the
    proximal pass's logprobs against the behaviour ones, the metrics are finite, the gradient is not 0."""
    grads, stats, batch, weights = _step(
        policy_path, trajs, off_policy="custom", rollout_correction=MODES[mode]
    )
    t = batch.tokens
    c = from_config(LearnerConfig(off_policy="custom", rollout_correction=MODES[mode]))
    want, sums, _ = correction_weights(t.old_logprobs, t.behaviour_logprobs, batch.mask, c)
    assert torch.equal(weights, want)
    for k in (
        "weight_mean",
        "behaviour_kl",
        "behaviour_kl_k1",
        "ppl_ratio",
        "masked_seq_frac",
        "truncated_frac",
    ):
        assert math.isfinite(stats[f"off_policy/{k}"]), k
    assert stats["off_policy/behaviour_kl"] > 0  # the behaviour logprobs carry noise
    assert stats["off_policy/clipped_frac"] > 0 and stats["off_policy/masked_token_frac"] < 1.0
    assert math.isfinite(stats["loss/policy"])
    assert any(float(g.abs().sum()) > 0 for g in grads[0].values())


def test_rejecting_every_sequence_leaves_no_policy_gradient(policy_path, trajs):
    """Geometric bounds [0.999, 1.001] reject every row here (the behaviour logprobs carry noise): every
    weight is 0, so the surrogate, the only loss term (no entropy bonus, KL in the reward), has no gradient."""
    block = {"reject": [{"level": "geometric", "bounds": [0.999, 1.001]}]}
    grads, stats, _, weights = _step(policy_path, trajs, off_policy="custom", rollout_correction=block)
    assert stats["off_policy/masked_seq_frac"] == 1.0 and float(weights.abs().sum()) == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in grads[0].values())


def test_the_bypass_mode_step_reads_the_behaviour_logprobs_and_measures_nothing(policy_path, trajs):
    _, stats, batch, weights = _step(policy_path, trajs, bypass=True, proximal_pass="bypass")
    assert torch.equal(batch.tokens.old_logprobs, batch.tokens.behaviour_logprobs)
    assert weights is None
    for k in ("off_policy/behaviour_kl", "off_policy/behaviour_kl_k1", "off_policy/ppl_ratio"):
        assert math.isnan(stats[k]), k
