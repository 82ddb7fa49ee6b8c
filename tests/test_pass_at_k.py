"""Held-out pass@k and mean@n (issue #24): the unbiased estimator against brute force, its edge cases,
the eval.pass_k config field, and an EvalRound of n samples per prompt scored by hand (no Ray: a round
is bookkeeping over its chunks' facts and scores)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from cluster.config.schema import ConfigError, build_config
from cluster.pipeline.evaluation import (
    EvalRound,
    before_after_lines,
    correctness_metrics,
    eval_metrics,
    headline,
    pass_at_k,
)
from cluster.prompts.loader import Prompt
from cluster.records.chunks import Chunk, EpisodeFacts, SampleFacts, every_sample
from reward_service.scorer import ScoreBatch


def brute_force(n: int, c: int, k: int) -> Fraction:
    """The fraction of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_the_brute_force_enumeration_of_k_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            want = brute_force(n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-12), (n, c, k)
            # the closed form 1 - C(n-c, k) / C(n, k), exactly
            assert want == 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_edge_cases():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 0, 5) == 0.0  # nothing correct
    assert pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 5, 3) == 1.0  # everything correct
    assert pass_at_k(5, 1, 5) == 1.0 and pass_at_k(5, 0, 5) == 0.0  # k = n: any correct one is drawn
    assert pass_at_k(6, 2, 5) == 1.0  # n - c = 4 < k: every 5-subset holds a correct one
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    for n, c in [(4, 1), (10, 3), (7, 7)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)  # pass@1 is the accuracy
    # by hand: n = 4, c = 1, k = 2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-15)


def test_pass_at_k_is_stable_where_binomials_overflow_a_float():
    # C(2000, 1000) ~ 2e600 does not fit a float64; the product form stays exact to ~1e-12
    want = 1 - Fraction(math.comb(2000 - 7, 1000), math.comb(2000, 1000))
    assert pass_at_k(2000, 7, 1000) == pytest.approx(float(want), abs=1e-12)
    assert 0.0 <= pass_at_k(2000, 1, 1) <= 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_correctness_metrics_by_hand():
    # prompt a: 1 of 4 right, b: 0 of 4, c: 4 of 4, interleaved (adjacency is not required)
    keys = ["a", "b", "c"] * 4
    flags = [k == "c" for k in keys]
    flags[0] = True  # a's first sample
    m = correctness_metrics(keys, flags, [1, 2, 4], 4)
    # pass@1 = mean(1/4, 0, 1) = 5/12; pass@2 = mean(1 - C(3,2)/C(4,2) = 1/2, 0, 1) = 1/2
    # pass@4 = mean(1, 0, 1) = 2/3; mean@4 = mean(1/4, 0, 1) = 5/12
    assert m == pytest.approx(
        {"eval/pass@1": 5 / 12, "eval/pass@2": 0.5, "eval/pass@4": 2 / 3, "eval/mean@4": 5 / 12}
    )
    assert correctness_metrics([], [], [1], 1) == pytest.approx(
        {"eval/pass@1": np.nan, "eval/mean@1": np.nan}, nan_ok=True
    )


# ---------------------------------------------------------------------------------- config


BASE = {
    "model": {"policy_path": "p"},
    "data": {"prompts_path": "prompts.jsonl", "meta_keys": ["answer"]},
    "reward": {"kind": "rule", "rule": "exact_integer"},
}


def config(**eval_fields):
    return build_config(
        {**BASE, "eval": {"prompts_path": "eval.jsonl", **eval_fields}, "rollout": {"chunk_size": 2}}
    )


def test_pass_k_defaults_and_validation_names_the_field():
    cfg = config()
    assert cfg.eval.samples_per_prompt == 1 and cfg.eval.pass_k == [1]
    from cluster.config.sections import EvalSection

    for name in ("samples_per_prompt", "pass_k", "correct_at"):
        assert EvalSection.model_fields[name].description
    assert config(samples_per_prompt=8, pass_k=[8, 1, 4, 4]).eval.pass_k == [1, 4, 8]
    assert config(pass_k=[]).eval.pass_k == []
    with pytest.raises(ConfigError, match=r"eval\.pass_k: k=4 .*eval\.samples_per_prompt=2"):
        config(samples_per_prompt=2, pass_k=[1, 4])
    with pytest.raises(ConfigError, match=r"eval\.pass_k"):
        config(pass_k=[2])  # samples_per_prompt defaults to 1
    with pytest.raises(ConfigError, match=r"eval\.pass_k\[0\]"):
        config(samples_per_prompt=2, pass_k=[0])
    with pytest.raises(ConfigError, match=r"eval\.pass_k"):
        config(pass_k="all")


# ---------------------------------------------------------------------------------- an EvalRound


def prompts(count: int) -> list[Prompt]:
    return [
        Prompt(index=100 + i, text=f"{i}+{i}=", ids=np.array([1, 5 + i]), meta={"answer": 2 * i})
        for i in range(count)
    ]


def score_like_a_worker(round_: EvalRound, rewards: dict[int, list[float]], failed=()) -> dict | None:
    """Fill every chunk as the rollout worker and the scorer would: the samples of a prompt consecutive,
    n per prompt (the chunk's own sampling.n); `failed`: (prompt index, sample) whose reward failed."""
    metrics = None
    for chunk in round_.chunks:
        n = chunk.sampling.n
        chunk.facts = [SampleFacts(p.index, 3, 2 + s, "stop") for p in chunk.prompts for s in range(n)]
        flat = [(p.index, s, rewards[p.index][s]) for p in chunk.prompts for s in range(n)]
        batch = ScoreBatch.empty(len(flat))
        for i, (index, s, r) in enumerate(flat):
            if (index, s) in failed:
                batch.fail(i, "rule raised")
            else:
                batch.set(i, r, "rule")
        chunk.scores = batch
        got = round_.scored(chunk)
        assert (got is None) == (chunk is not round_.chunks[-1])
        metrics = got
    return metrics


def test_an_eval_round_samples_n_per_prompt_and_reports_pass_at_k_from_the_scores():
    cfg = config(samples_per_prompt=4, pass_k=[1, 2, 3, 4])
    ps = prompts(3)
    round_ = EvalRound(7, ps, cfg)
    assert [len(c.prompts) for c in round_.chunks] == [2, 1]  # rollout.chunk_size prompts per chunk
    assert all(c.eval and c.sampling.n == 4 for c in round_.chunks)  # n responses per held-out prompt
    rewards = {100: [0.0, 1.0, 0.0, 0.0], 101: [0.0, 0.0, 0.0, 0.0], 102: [1.0, 0.0, 1.0, 0.0]}
    m = score_like_a_worker(round_, rewards)
    # c = (1, 0, 2) of n = 4:
    # pass@1 = mean(1/4, 0, 2/4) = 0.25
    # pass@2 = mean(1 - C(3,2)/C(4,2) = 1/2, 0, 1 - C(2,2)/C(4,2) = 5/6) = 4/9
    # pass@3 = mean(1 - C(3,3)/C(4,3) = 3/4, 0, 1 (n - c = 2 < 3)) = 7/12
    # pass@4 = mean(1, 0, 1) = 2/3;  mean@4 = mean(1/4, 0, 1/2) = 0.25 = eval/accuracy (3 of 12)
    assert m["eval/pass@1"] == pytest.approx(0.25)
    assert m["eval/pass@2"] == pytest.approx(4 / 9)
    assert m["eval/pass@3"] == pytest.approx(7 / 12)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/mean@4"] == pytest.approx(0.25) and m["eval/accuracy"] == pytest.approx(0.25)
    # the metrics that were there before keep their names and meaning
    assert m["eval/samples"] == 12.0 and m["eval/reward_failures"] == 0.0
    assert m["eval/reward_mean"] == pytest.approx(0.25)
    assert m["eval/response_length"] == pytest.approx(3.5)  # lengths 2, 3, 4, 5 per prompt
    assert m["eval/requested_at_step"] == 7.0 and m["eval/policy_version"] == 3.0
    assert "pass@2 0.444" in headline(m) and "pass@4 0.667" in headline(m)
    assert "pass@3 0.583 -> 0.583" in before_after_lines(m, m, "held-out")[0]


def test_the_correct_threshold_is_reward_at_least_correct_at():
    rewards = {100: [0.5, 0.49], 101: [0.0, 0.0]}
    at_half = score_like_a_worker(
        EvalRound(1, prompts(2), config(samples_per_prompt=2, correct_at=0.5)), rewards
    )
    # prompt 100: 0.5 >= 0.5 counts, 0.49 does not -> c = 1 of 2; prompt 101: 0 of 2
    assert at_half["eval/pass@1"] == pytest.approx(0.25) and at_half["eval/mean@2"] == pytest.approx(0.25)
    default = score_like_a_worker(EvalRound(1, prompts(2), config(samples_per_prompt=2)), rewards)
    assert default["eval/pass@1"] == 0.0 and default["eval/mean@2"] == 0.0  # default correct_at 1.0


def test_a_sample_whose_reward_failed_is_a_wrong_answer_never_left_out():
    """Issue 56 item 8: leaving failed samples out inflated the held-out numbers (here 3/5 and 2/3)."""
    cfg = config(samples_per_prompt=3, pass_k=[1, 3])
    rewards = {100: [1.0, 0.0, 0.0], 101: [1.0, 1.0, 0.0]}
    m = score_like_a_worker(EvalRound(1, prompts(2), cfg), rewards, failed={(101, 1)})
    # prompt 100: c = 1 of 3; prompt 101: c = 1 of 3 (its failed sample, which scored 1.0 otherwise, is wrong)
    # pass@1 = mean(1/3, 1/3) = 1/3; pass@3: 1 for both (n - c = 2 < 3); mean@3 = 1/3
    assert m["eval/pass@1"] == pytest.approx(1 / 3) and m["eval/pass@3"] == pytest.approx(1.0)
    assert m["eval/mean@3"] == pytest.approx(1 / 3)
    assert m["eval/accuracy"] == pytest.approx(2 / 6) and m["eval/reward_failures"] == 1.0


def test_no_pass_at_k_for_rewards_that_are_not_rules():
    cfg = build_config(
        {
            **BASE,
            "reward": {"kind": "model", "model_path": "r"},
            "eval": {"prompts_path": "eval.jsonl", "samples_per_prompt": 2, "pass_k": [2]},
        }
    )
    m = score_like_a_worker(EvalRound(1, prompts(1), cfg), {100: [0.3, 2.0]})
    assert not any(k.startswith(("eval/pass@", "eval/mean@")) for k in m) and "eval/accuracy" not in m
    assert m["eval/reward_mean"] == pytest.approx(1.15)


def test_held_out_episode_metrics_count_the_failed_episodes_too():
    """eval/env/*, as env/* in training: an episode whose environment failed is dropped from the scores
    (eval/samples) but counted among the episodes and in eval/env/failures, and is a wrong answer."""
    chunk = Chunk(0, prompts(3), seed=0)
    chunk.facts = [
        SampleFacts(100 + i, 3, 5, "stop", EpisodeFacts(2, status, 5, 3, 0.5, {"tool_calls": 1}))
        for i, status in enumerate(("done", "env_error", "env_timeout"))
    ]
    chunk.scores = ScoreBatch.empty(3)
    chunk.scores.set(0, 1.0, "rule")
    chunk.scores.fail(1, "environment raised")
    chunk.scores.fail(2, "environment timed out")
    m = eval_metrics(config(), every_sample([chunk]))
    assert m["eval/samples"] == 1.0 and m["eval/accuracy"] == pytest.approx(1 / 3)
    assert m["eval/env/episodes"] == 3.0 and m["eval/env/failures"] == 2.0
    assert m["eval/env/status/env_error"] == 1.0 and m["eval/env/status/env_timeout"] == 1.0
    assert m["eval/env/status/done"] == 1.0 and m["eval/env/turns"] == 2.0
