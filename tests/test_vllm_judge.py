"""The LLM judge served by vLLM (reward.judge.engine='vllm', `make test-vllm`): the tiny judge of
test_reward_judge (head size 32, which vLLM's CPU attention needs), its verdicts equal to those the
transformers judge gives the same prompts, and a run that trains on them."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from extras import needs
from test_reward_judge import INPUTS, _input, assert_judged, judge_run_config
from tiny_models import build_judge

from cluster.roles.judge_engines import judge_model
from reward_service.config import JudgeConfig, RewardConfig
from reward_service.judge import JudgeReward

pytestmark = needs("vllm")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_judge(tmp_path_factory.mktemp("judge"), n_embd=64)


@pytest.fixture(scope="module")
def seven_dir(tmp_path_factory):
    return build_judge(tmp_path_factory.mktemp("judge7"), reply="7", n_embd=64)


def _both(judge: JudgeConfig, batch_size: int = 3) -> tuple[JudgeReward, JudgeReward]:
    reward = RewardConfig(kind="judge", judge=judge.model_copy(update={"engine": "vllm"}))
    served = JudgeReward(reward.judge, batch_size, model=judge_model(reward))
    return served, JudgeReward(judge.model_copy(update={"engine": "hf"}), batch_size)


def test_the_vllm_judge_gives_the_transformers_judges_verdicts(judge_dir, seven_dir):
    """yes/no: P(yes) / (P(yes) + P(no)) from vLLM's teacher-forced logprobs equals the hf forward's
    (float32 both); score: the greedy reply and its score are the same; a prompt longer than the
    engine takes (its 64 positions less the token the yes/no probe appends) fails alone, by name."""
    served, hf = _both(JudgeConfig(model_path=str(judge_dir)))
    (got, errors, _), (want, hf_errors, _) = served.score(INPUTS), hf.score(INPUTS)
    assert errors == hf_errors == [None] * len(INPUTS)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert len({round(float(s), 6) for s in got}) > 1

    long = _input("Is", " ".join(["5"] * 48))  # fits hf's 64 positions, not the probe's 63
    n = len(served.encode(served.prompt_text(long)))
    assert n == 64, n
    _, errors, _ = served.score([long, INPUTS[0]])
    assert "more than the judge's context allows (63)" in errors[0] and errors[1] is None
    assert hf.score([long])[1] == [None]

    # One vLLM engine in this process at a time: dropping an engine tears down vLLM's process-wide
    # parallel groups, which an engine built before the drop still uses.
    del served
    gc.collect()
    served, hf = _both(JudgeConfig(model_path=str(seven_dir), verdict="score", max_new_tokens=3), 2)
    scores, errors, replies = served.score(INPUTS[:3])
    assert errors == [None] * 3, errors
    assert (scores.tolist(), errors, replies) == ([7.0] * 3, [None] * 3, ["7 7 7"] * 3)
    assert replies == hf.score(INPUTS[:3])[2]
    del served
    gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["separate", "colocated"])
def test_a_run_trains_on_the_vllm_judges_verdicts(ray_local, demo_assets, judge_dir, tmp_path, placement):
    """The demo (hf rollouts) with the judge on vLLM, as its own actor or in the learner rank's host:
    every sample whose row has the reference is scored in (0, 1), the others fail and are counted."""
    from cluster.pipeline.run import Run

    cfg = judge_run_config(
        demo_assets, judge_dir, tmp_path, placement, steps=1, **{"reward.judge.engine": "vllm"}
    )
    run = Run(cfg, tmp_path / "run")
    try:
        assert "judge" in run.roles.by_role and "reward" not in run.roles.by_role
        m = run.iteration()
    finally:
        run.close()
    assert_judged(m)
