"""The adapter from the rollout roles' output to the learner's input: a scored sample and its
reference logprobs become a `Trajectory`, and a learner rank's part of a chunk becomes its
trajectories (assembled on the rank, from the objects the part's references name)."""

from __future__ import annotations

from typing import Any

from cluster.records.groups import RankPart
from learner.trajectory import Trajectory


def to_trajectory(
    sample: Any, ref_logprobs: Any, score: float, group: int = -1, turn_rewards: bool = False
) -> Trajectory:
    """The learner's record of one scored rollout sample; `group` is shared by the samples of one prompt.

    A multi-turn episode trains the environment's earlier-turn rewards (each on its turn's last token)
    beside the score only with `turn_rewards` (the scorer's `ScoreBatch.turn_rewards`: reward.kind
    'environment', whose score is the last turn's reward); otherwise the score is its whole reward."""
    episode = sample.episode
    return Trajectory(
        prompt_ids=sample.prompt_ids,
        response_ids=sample.response_ids,
        behaviour_logprobs=sample.logprobs,
        ref_logprobs=ref_logprobs,
        score=float(score),
        policy_version=sample.policy_version,
        group=int(group),
        truncated=sample.finish_reason == "length",
        action_mask=None if episode is None else episode.loss_mask,
        token_rewards=episode.token_rewards() if episode is not None and turn_rewards else None,
        routing=sample.routing,
    )


def part_trajectories(part: RankPart, samples: list, ref_logprobs: list | None) -> list[Trajectory]:
    """The trajectories of one learner part (`cluster.records.groups.shard_parts`), given its chunk's
    samples and reference logprobs (the objects its references name; None where the learner computes
    the reference itself, learner.reference_from_base)."""
    return [
        to_trajectory(
            samples[j], None if ref_logprobs is None else ref_logprobs[j], score, group, part.turn_rewards
        )
        for j, score, group in part.picks
    ]
