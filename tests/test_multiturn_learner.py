"""The learner on multi-turn episodes, with numbers worked by hand: observation tokens are no actions
(no advantage, no value target, no KL), GAE steps from one model token to the next across them, each
earlier turn's reward sits on its turn's last token, the outcome on the last model token, and the
group estimators take the episode's return."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.advantages import (
    AdvantageInputs,
    AdvantageParams,
    compaction,
    estimate,
    has_gaps,
    place_token_rewards,
    uncompact,
)
from learner.algorithms import shape_rewards
from learner.batch import Trajectory, pack_trajectories

# A 2-turn episode: model tokens m0 m1, observation o0 o1, model tokens m2 m3.
MASK2 = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
VALUES2 = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])  # 9: values at observation tokens never count


def estimate_with(estimator, *, gamma, lam, group_std=True, **inputs):
    """`estimate` with the inputs and settings as keywords."""
    return estimate(estimator, AdvantageInputs(**inputs), AdvantageParams(gamma, lam, group_std))


def gae(rewards, values, mask, gamma, lam, scores=None, groups=None, estimator="gae"):
    return estimate_with(
        estimator,
        scores=torch.zeros(rewards.shape[0]) if scores is None else scores,
        rewards=rewards,
        values=values,
        mask=mask,
        gamma=gamma,
        lam=lam,
        groups=groups,
    )


def test_two_turn_gae_by_hand():
    # turn 1's reward 0.5 on m1 (its last token), outcome 1.0 on m3; gamma 0.9, lambda 0.5
    scores = torch.tensor([1.0])
    rewards, kl = shape_rewards(scores, torch.zeros(1, 6), torch.zeros(1, 6), MASK2, 0.0)
    rewards, scores = place_token_rewards("gae", rewards, scores, torch.tensor([[0, 0.5, 0, 0, 0, 0]]), MASK2)
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 1.0]]
    adv, ret = gae(rewards, VALUES2, MASK2, gamma=0.9, lam=0.5)
    # compacted: r = [0, .5, 0, 1], V = [.1, .2, .3, .4]
    # d3 = 1 - .4 = .6;               A3 = .6
    # d2 = .9*.4 - .3 = .06;          A2 = .06 + .45*.6 = .33
    # d1 = .5 + .9*.3 - .2 = .57;     A1 = .57 + .45*.33 = .7185
    # d0 = .9*.2 - .1 = .08;          A0 = .08 + .45*.7185 = .403325
    want = [0.403325, 0.7185, 0.0, 0.0, 0.33, 0.6]
    np.testing.assert_allclose(adv[0].tolist(), want, atol=1e-6)
    np.testing.assert_allclose(ret[0].tolist(), [0.503325, 0.9185, 0.0, 0.0, 0.63, 1.0], atol=1e-6)


def test_three_turn_returns_skip_observations_and_match_the_compact_episode():
    # m0 | o | m1 m2 | o o | m3; rewards 1 on m0 (turn 1), 2 on m2 (turn 2), outcome 4 on m3; gamma 0.5, lam 1
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])  # then padding
    token_rewards = torch.tensor([[1.0, 0, 0, 2.0, 0, 0, 0, 0]])
    rewards, _ = shape_rewards(torch.tensor([4.0]), torch.zeros(1, 8), torch.zeros(1, 8), mask, 0.0)
    rewards, _ = place_token_rewards("gae", rewards, torch.tensor([4.0]), token_rewards, mask)
    adv, ret = gae(rewards, torch.zeros(1, 8), mask, gamma=0.5, lam=1.0)
    # returns over the 4 model tokens [1, 0, 2, 4]: G3 = 4, G2 = 2 + 2 = 4, G1 = 0 + 2 = 2, G0 = 1 + 1 = 2
    assert ret[0].tolist() == [2.0, 0.0, 2.0, 4.0, 0.0, 0.0, 4.0, 0.0]
    assert adv[0].tolist() == ret[0].tolist()  # V = 0
    # the same as a single-turn row made of the model tokens only
    compact = gae(torch.tensor([[1.0, 0.0, 2.0, 4.0]]), torch.zeros(1, 4), torch.ones(1, 4), 0.5, 1.0)[1]
    np.testing.assert_allclose(ret[0][mask[0] > 0].tolist(), compact[0].tolist())


def test_group_estimators_take_the_episode_return_and_keep_the_kl_part():
    # two episodes of one prompt: returns 1 + 0.5 (turn reward) = 1.5 and 0; grpo without std: +-0.75
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.0, 0.2], [0.3, 0.4, 0.0]])  # per-token KL penalties (beta = 1)
    rewards, _ = shape_rewards(torch.tensor([1.0, 0.0]), kl, torch.zeros(2, 3), mask, 1.0)
    rewards, scores = place_token_rewards(
        "grpo", rewards, torch.tensor([1.0, 0.0]), torch.tensor([[0.5, 0, 0], [0, 0, 0]]), mask
    )
    assert scores.tolist() == [1.5, 0.0]
    adv, _ = estimate_with(
        "grpo",
        scores=scores,
        rewards=rewards,
        values=torch.zeros(2, 3),
        mask=mask,
        gamma=1.0,
        lam=1.0,
        groups=torch.tensor([0, 0]),
        group_std=False,
    )
    # outcome advantage +-0.75 on every model token, plus the KL return-to-go over model tokens only
    np.testing.assert_allclose(
        adv.tolist(), [[0.75 - 0.3, 0.0, 0.75 - 0.2], [-0.75 - 0.7, -0.75 - 0.4, 0.0]], atol=1e-6
    )


def test_kl_and_scores_only_on_model_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]])
    rewards, kl = shape_rewards(torch.tensor([2.0]), logprobs, torch.zeros(1, 6), MASK2, 0.1)
    assert kl[0].tolist() == [-1.0, -2.0, 0.0, 0.0, -5.0, -6.0]
    np.testing.assert_allclose(rewards[0].tolist(), [0.1, 0.2, 0.0, 0.0, 0.5, 2.6], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compaction_is_a_permutation_and_a_no_op_on_prefix_masks(seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(5, 9, generator=g) > 0.4).float()
    x = torch.randn(5, 9, generator=g) * mask
    index = compaction(mask)
    packed = mask.gather(1, index)
    assert not has_gaps(packed)  # valid tokens first, in order
    assert torch.equal(uncompact(x.gather(1, index), index), x)
    prefix = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert not has_gaps(prefix) and torch.equal(compaction(prefix), torch.arange(3).expand(2, 3))


def test_packed_batch_masks_observations_and_keeps_response_lengths():
    t = Trajectory(
        prompt_ids=np.array([1, 5]),
        response_ids=np.array([7, 8, 9, 10, 11]),
        behaviour_logprobs=np.array([-1, -1, 0, 0, -1], dtype=np.float32),
        ref_logprobs=np.zeros(5, dtype=np.float32),
        score=1.0,
        action_mask=np.array([1, 1, 0, 0, 1], dtype=np.uint8),
        token_rewards=np.array([0, 0.5, 0, 0, 0], dtype=np.float32),
    )
    single = Trajectory(
        np.array([1]), np.array([4, 2]), np.zeros(2, np.float32), np.zeros(2, np.float32), 0.0
    )
    batch = pack_trajectories([t, single], pad_id=0)
    assert batch.mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert batch.response_lens.tolist() == [5, 2]
    assert batch.tokens.token_rewards.tolist() == [[0, 0.5, 0, 0, 0], [0, 0, 0, 0, 0]]
    part = batch.take(torch.tensor([0]))
    assert part.mask.shape == (1, 5)  # trimmed by response length, not by the mask's sum
    with pytest.raises(ValueError, match="mask entries"):
        t.action_mask = np.ones(3, dtype=np.uint8)
        pack_trajectories([t], pad_id=0)


# ----------------------------------------------------------------- which rewards an episode trains on

# A 2-turn episode: "good film" | observation "the" | "very good"; the environment gave -0.25 for turn 1
# and 1.0 (the outcome) for turn 2.
EPISODE_RESPONSE = np.array([11, 6, 4, 25, 11])


def _episode_sample():
    from rollout_workers.environment import Episode
    from rollout_workers.types import Sample

    episode = Episode(
        loss_mask=np.array([1, 1, 0, 1, 1], dtype=np.uint8),
        turn_ends=np.array([1, 4]),
        turn_rewards=np.array([-0.25, 1.0], dtype=np.float32),
        status="done",
    )
    return Sample(0, np.array([4, 5]), EPISODE_RESPONSE, np.zeros(5, np.float32), "stop", 0, episode=episode)


def test_a_score_from_another_reward_kind_takes_none_of_the_environments_turn_rewards():
    """The scorer's score (here a rule's 0.5) is the whole reward of an episode scored by any kind but
    'environment': the environment's earlier-turn rewards (the -0.25) are not added beside it."""
    from cluster.records.trajectories import to_trajectory

    t = to_trajectory(_episode_sample(), np.zeros(5, np.float32), 0.5)
    assert t.token_rewards is None and t.action_mask.tolist() == [1, 1, 0, 1, 1]
    assert pack_trajectories([t], pad_id=0).tokens.token_rewards is None


@pytest.mark.parametrize("kind", ["environment", "rule"])
def test_the_reward_kind_decides_whether_all_or_none_of_the_environments_rewards_are_trained(kind, tmp_path):
    """Scorer -> the learner's parts -> trajectories, as a run builds them. kind='environment': every turn's
    reward (outcome 1.0 as the score on the last token, -0.25 on turn 1's last token: 0.75 in all); a rule:
    its score alone (0.5: one of the two keywords), none of the environment's."""
    from tiny_models import build_tokenizer

    from cluster.prompts.loader import Prompt
    from cluster.records.chunks import Chunk, sample_facts
    from cluster.records.groups import shard_parts
    from cluster.records.trajectories import part_trajectories
    from reward_service.config import RewardConfig
    from reward_service.scorer import RewardScorer

    build_tokenizer().save_pretrained(tmp_path)
    sample = _episode_sample()
    config = RewardConfig(kind=kind, rule="contains_keyword" if kind == "rule" else None)
    meta = {"keywords": ["good", "plot"]}
    scored = RewardScorer(config, str(tmp_path)).score(
        [sample.prompt_ids], [sample.response_ids], [meta], [sample.episode]
    )
    assert scored.turn_rewards == (kind == "environment")
    chunk = Chunk(0, [Prompt(0, "the movie", sample.prompt_ids, meta)], seed=0)
    chunk.facts, chunk.scores = [sample_facts(sample)], scored
    chunk.samples_ref, chunk.ref_logprobs_ref = "samples", "reference logprobs"
    (((part,), _chunks),) = shard_parts([(chunk, [0])], 1, "count")
    assert part.turn_rewards == (kind == "environment")
    (t,) = part_trajectories(part, [sample], [np.zeros(5, np.float32)])
    if kind == "environment":
        assert t.score == 1.0 and t.token_rewards.tolist() == [0.0, -0.25, 0.0, 0.0, 0.0]
    else:
        assert t.score == 0.5 and t.token_rewards is None


def test_the_learner_trains_and_reports_the_episodes_return(tiny_policy_dir):
    """One group of four episodes, right in the end after 0-3 wrong guesses (-0.05 each): outcomes 1.0,
    returns 1, .95, .9, .85 (the return dynamic sampling filters on, tests/test_dynamic_sampling.py).
    grpo (kl 0): mean .925, std sqrt(.0125 / 3) = .0645497: advantages +-1.161895 and +-0.387298 on every
    model token; train/reward_mean is the mean return, .925, as the driver's rollout/reward_mean."""
    from test_dynamic_sampling import _guess_episode
    from test_learner_packing import GradientTap

    from cluster.records.trajectories import to_trajectory
    from learner.config import LearnerConfig
    from learner.context import LearnerContext
    from learner.model import PolicyWithValueHead
    from learner.prepare import prepare

    samples = [_guess_episode(k) for k in range(4)]
    trajs = [to_trajectory(s, np.zeros(len(s.response_ids), np.float32), 1.0, 0, True) for s in samples]
    batch = pack_trajectories(trajs, pad_id=0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(tiny_policy_dir))
    stats = prepare(LearnerContext(tap, LearnerConfig(advantage="grpo"), 1.0, 0), batch, 0.0)
    assert stats["train/reward_mean"] == pytest.approx(0.925, rel=1e-6)
    adv = batch.tokens.advantages
    for row, want in enumerate([1.161895, 0.387298, -0.387298, -1.161895]):
        valid = batch.mask[row] > 0
        np.testing.assert_allclose(adv[row][valid].tolist(), [want] * int(valid.sum()), atol=1e-4)
        assert adv[row][~valid].abs().sum() == 0


@pytest.mark.parametrize(
    "mode, clip, want",
    [
        # G / 2: turn penalties -1 -> -0.5, outcomes 0, 2, 3 -> 0, 1, 1.5
        ("scale", None, [[-0.5, -0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 1.0], [1.5, 1.5, 1.5, 1.5]]),
        # (G - 1) / 2 = -1, 0, 1: turn penalties -0.5, the outcomes take the rest (-0.5, 0.5, 1)
        ("standardize", None, [[-1.0, -1.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0]]),
        # the normalised returns clipped to [-0.75, 0.75]: -0.75, 0, 0.75; outcomes -0.25, 0.5, 0.75
        ("standardize", 0.75, [[-0.75, -0.75, 0.0, -0.25], [0.0, 0.0, 0.0, 0.5], [0.75, 0.75, 0.75, 0.75]]),
    ],
)
def test_reward_norm_normalises_the_episode_return_turn_rewards_included(tiny_policy_dir, mode, clip, want):
    """Three samples: two 2-turn episodes (m m | o | m) with a -1 penalty on turn 1 and outcomes 0 and 2,
    and a single response scored 3: returns G = -1, 1, 3, running mean 1 and std 2. Every reward is
    divided by the same std (the penalty too), the mean comes off once (from the outcome) and a clip
    bounds the return. gae with V = 0 (zero value head), gamma = lam = 1, no KL and no whitening: each
    model token's advantage is the normalised reward to go."""
    from test_learner_packing import GradientTap

    from learner.config import LearnerConfig
    from learner.context import LearnerContext
    from learner.critic import RunningMoments
    from learner.model import PolicyWithValueHead
    from learner.prepare import prepare

    def episode(score):
        return Trajectory(
            np.array([4, 5]), np.array([11, 6, 4, 25]), np.zeros(4, np.float32), np.zeros(4, np.float32), score,
            action_mask=np.array([1, 1, 0, 1], dtype=np.uint8),
            token_rewards=np.array([0.0, -1.0, 0.0, 0.0], dtype=np.float32),
        )  # fmt: skip

    single = Trajectory(
        np.array([4, 5]), np.array([11, 6, 4, 25]), np.zeros(4, np.float32), np.zeros(4, np.float32), 3.0
    )
    batch = pack_trajectories([episode(0.0), episode(2.0), single], pad_id=0)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(tiny_policy_dir))
    config = LearnerConfig(
        advantage="gae",
        gamma=1.0,
        gae={"lam": 1.0},
        whiten_advantages=False,
        reward_norm=mode,
        reward_norm_clip=clip,
    )
    stats = prepare(LearnerContext(tap, config, 1.0, 0, reward_moments=RunningMoments()), batch, 0.0)
    np.testing.assert_allclose(batch.tokens.advantages.tolist(), want, atol=1e-6)
    assert (stats["reward_norm/count"], stats["reward_norm/mean"]) == (3.0, pytest.approx(1.0))
    assert stats["reward_norm/std"] == pytest.approx(2.0)
    assert stats["train/reward_mean"] == pytest.approx(1.0)  # the raw returns' mean
