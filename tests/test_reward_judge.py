"""An LLM as the reward (reward.kind='judge'): a tiny judge built here, with a tokenizer and chat template
of its own. Its yes/no verdict equals each prompt scored alone (batching and left padding change
nothing), its score verdict is read from its greedy reply and checked against the range, and a sample
it cannot judge fails with the reason, never as a 0."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tiny_models import build_judge
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.config.schema import ConfigError, build_config
from reward_service.config import JudgeConfig, RewardConfig
from reward_service.functions import RewardInput
from reward_service.judge import JudgeReward
from reward_service.scorer import RewardScorer


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return build_judge(tmp_path_factory.mktemp("judge"))


@pytest.fixture(scope="module")
def seven_dir(tmp_path_factory):
    return build_judge(tmp_path_factory.mktemp("judge7"), reply="7")


def _input(question: str, response: str, answer: str | None = "4") -> RewardInput:
    meta = {} if answer is None else {"answer": answer}
    return RewardInput(
        prompt=f"rendered {question}",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": question}],
        response=response,
        response_ids=[],
        finish_reason="stop",
        meta=meta,
    )


INPUTS = [
    _input("Is 2 + 2", "4"),
    _input("Is 3 + 1", "the answer is 4 Yes"),
    _input("Is 9", "No 5 5 5 5 5 5 5 5 5"),
    _input("Is", ""),
    _input("Question: 1 2 3", "0 1 2 3 4 5 6 7 8 9"),
]


def test_yes_no_is_each_prompt_scored_alone_in_the_judges_chat_template(judge_dir):
    judge = JudgeReward(JudgeConfig(model_path=str(judge_dir)), batch_size=3)
    scores, errors, _ = judge.score(INPUTS)
    assert errors == [None] * len(INPUTS)
    tok = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
    for x, got in zip(INPUTS, scores, strict=True):
        filled = JudgeConfig().template.format(
            question=x.messages[-1]["content"], response=x.response, reference="4"
        )
        text = tok.apply_chat_template(
            [{"role": "user", "content": filled}], tokenize=False, add_generation_prompt=True
        )
        assert text.startswith("<|user|> Question: ") and text.endswith("<|assistant|> ")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert judge.encode(judge.prompt_text(x)) == ids
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
        expected = math.exp(logp[yes]) / (math.exp(logp[yes]) + math.exp(logp[no]))
        assert float(got) == pytest.approx(expected, abs=1e-5)
    assert len({round(float(s), 6) for s in scores}) > 1  # the prompts differ, so do the verdicts


def test_score_verdict_reads_the_greedy_reply_and_checks_its_range(seven_dir):
    score = JudgeConfig(model_path=str(seven_dir), verdict="score", max_new_tokens=3)
    scores, errors, replies = JudgeReward(score, batch_size=2).score(INPUTS[:3])
    assert scores.tolist() == [7.0, 7.0, 7.0] and errors == [None] * 3
    assert replies == ["7 7 7"] * 3
    narrow = score.model_copy(update={"score_range": (0.0, 5.0)})
    scores, errors, _ = JudgeReward(narrow).score(INPUTS[:1])
    assert np.isnan(scores[0]) and "outside reward.judge.score_range [0, 5]" in errors[0]
    other = score.model_copy(update={"score_pattern": r"score: (\d+)"})
    _, errors, _ = JudgeReward(other).score(INPUTS[:1])
    assert "has no score (reward.judge.score_pattern): '7 7 7'" in errors[0]


def test_a_row_without_its_reference_fails_alone(judge_dir):
    judge = JudgeReward(JudgeConfig(model_path=str(judge_dir)))
    scores, errors, _ = judge.score([INPUTS[0], _input("Is 1", "1", answer=None), INPUTS[1]])
    assert errors[0] is None and errors[2] is None and np.isfinite(scores[[0, 2]]).all()
    assert np.isnan(scores[1]) and "'answer' (reward.judge.reference_key)" in errors[1]
    # a template without {reference} needs none
    free = JudgeReward(JudgeConfig(model_path=str(judge_dir), template="Is {response} correct?"))
    assert free.score([_input("Is 1", "1", answer=None)])[1] == [None]


def test_a_prompt_longer_than_the_judges_context_fails(judge_dir):
    judge = JudgeReward(JudgeConfig(model_path=str(judge_dir)))
    _, errors, _ = judge.score([_input("Is", " ".join(["5"] * 80)), INPUTS[0]])
    assert "more than the judge's context allows (64)" in errors[0] and errors[1] is None


def test_bad_judge_settings_name_the_field(judge_dir):
    with pytest.raises(ValueError, match=r"reward.judge.yes='Yes please' is 2 tokens"):
        JudgeReward(JudgeConfig(model_path=str(judge_dir), yes="Yes please"))
    with pytest.raises(
        ValueError, match=r"uses \{answer\}; allowed: \{question\}, \{response\}, \{reference\}"
    ):
        JudgeConfig(template="{question} {answer}")
    with pytest.raises(ValueError, match="score_range"):
        JudgeConfig(score_range=(5, 1))
    tree = {"model": {"policy_path": "p"}, "data": {"prompts_path": "x.jsonl"}}
    with pytest.raises(ConfigError, match="reward.judge.model_path is required"):
        build_config({**tree, "reward": {"kind": "judge"}})
    # the judge is a role of its own: the scorer's counts and resources would go unused
    for field, value in (("num_replicas", 2), ("num_gpus", 1.0), ("num_cpus", 1.0), ("resources", {"r": 1})):
        with pytest.raises(ConfigError, match=f"reward.{field}: .*set reward.judge.{field} instead"):
            build_config({**tree, "reward": {"kind": "judge", "judge": {"model_path": "j"}, field: value}})
    cfg = build_config(
        {
            **tree,
            "reward": {"kind": "judge", "num_cpus": 0.25, "judge": {"model_path": "j", "num_replicas": 2}},
        }
    )
    assert cfg.reward.judge.num_replicas == 2  # a scorer field at its default is no conflict


def test_every_judge_engine_is_registered_and_only_the_cluster_serves_vllm(judge_dir):
    """reward.judge.engine's allowed values are the registry's (cluster.roles.judge_engines); the judge
    built without the cluster's model refuses an engine other than hf instead of quietly using hf."""
    from typing import get_args

    from cluster.roles.judge_engines import JUDGE_ENGINES, judge_model
    from reward_service.judge import HFJudgeModel

    assert get_args(JudgeConfig.model_fields["engine"].annotation) == JUDGE_ENGINES.names()
    served = JudgeConfig(model_path=str(judge_dir), engine="vllm")
    with pytest.raises(ValueError, match="reward.judge.engine='vllm' is served by the model the cluster"):
        JudgeReward(served)
    assert isinstance(
        judge_model(RewardConfig(kind="judge", judge=JudgeConfig(model_path=str(judge_dir)))), HFJudgeModel
    )


def test_the_scorer_serves_the_judge_and_counts_its_failures(judge_dir, tiny_policy_dir):
    """The reward scorer actor's class with kind='judge': policy ids decoded, the judge's verdicts as
    the scores, a row without its reference failed and counted."""
    tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
    prompts = [np.array(tok("the movie was")["input_ids"]), np.array(tok("i loved it")["input_ids"])]
    responses = [np.array(tok("great .")["input_ids"]), np.array(tok("bad")["input_ids"])]
    config = RewardConfig(kind="judge", judge=JudgeConfig(model_path=str(judge_dir)), batch_size=4)
    scorer = RewardScorer(config, str(tiny_policy_dir))
    out = scorer.score(prompts, responses, [{"answer": "yes"}, {}])
    assert out.ok.tolist() == [True, False] and "reference_key" in out.errors[1]
    assert 0.0 < out.scores[0] < 1.0 and out.returns[0] == out.scores[0]
    assert scorer.stats()["failures"] == 1.0
    direct = JudgeReward(config.judge).score(
        [RewardInput("the movie was", None, "great .", [], None, {"answer": "yes"})]
    )[0]
    assert float(out.scores[0]) == pytest.approx(float(direct[0]), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_a_run_trains_on_the_judges_verdicts_and_drops_what_it_cannot_judge(
    ray_local, demo_assets, judge_dir, tmp_path, placement
):
    """The demo with the judge as its reward: the judge is a role of its own (judge actors, no reward
    scorer), in the learner rank's process (colocated) or as its own actors, scaled 1 -> 2 between steps
    (separate). Rows without the reference fail their samples, counted and never trained; every other
    sample is scored by the judge, in [0, 1]. Scaling a reward scorer is refused: none runs."""
    import ray

    from cluster.pipeline.run import Run
    from cluster.scale import main as scale_main

    cfg = judge_run_config(demo_assets, judge_dir, tmp_path, placement, steps=2)
    trainer = Run(cfg, tmp_path / "run")
    try:
        assert "judge" in trainer.roles.by_role and "reward" not in trainer.roles.by_role
        metrics = [trainer.iteration()]
        if placement == "separate":
            assert scale_main(["--run", trainer.run_id, "judge=2"]) == 0
        metrics.append(trainer.iteration())
        judges = trainer.roles.by_role["judge"].names
        with pytest.raises(ray.exceptions.RayTaskError, match="no reward actors to scale|colocated"):
            ray.get(trainer.control.set_target.remote("reward", 2), timeout=30)
    finally:
        trainer.close()
    if placement == "separate":
        assert len(judges) == 2 and all(n.startswith("reward-judge-") for n in judges)
    for m in metrics:
        assert_judged(m)


def judge_run_config(demo_assets, judge_dir, tmp_path, placement: str, steps: int, **sets):
    """The demo's config with `judge_dir` as its reward on its first 64 prompts, every fourth row
    without the reference (`answer`) the judge's template reads, so those samples fail."""
    import json

    from demo_run import CONFIG, demo_overrides

    from cluster.config.schema import load_config

    rows = [json.loads(line) for line in demo_assets.prompts.read_text().splitlines()[:64]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({**r, "answer": "Yes"} if i % 4 else r) + "\n" for i, r in enumerate(rows))
    )
    judge = {
        "cluster.placement": placement,
        "data.prompts_path": prompts,
        "reward.kind": "judge",
        "reward.model_path": None,
        "reward.judge.model_path": judge_dir,
        "reward.max_failure_frac": 0.5,
    }
    return load_config(CONFIG, demo_overrides(demo_assets, steps, **judge, **sets))


def assert_judged(m: dict) -> None:
    """A step of `judge_run_config`'s run: the rows without the reference failed, counted and never
    trained; the others were trained on verdicts in (0, 1)."""
    failed, trained = m["rollout/reward_failures"], m["train/sequences"]
    assert failed > 0 and trained > 0 and failed + trained == 64, m
    assert 0.0 < m["rollout/reward_mean"] < 1.0
