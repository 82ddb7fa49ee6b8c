"""GRPO on a reward that depends on the prompt only trains with zero gradient: a real run (Ray, one
DeepSpeed rank, the tests' tiny policy) says so once, after `flat_groups.STEPS` steps of flat groups."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from demo_run import CONFIG, demo_overrides

PROMPT_ONLY = """
def by_prompt(prompt, response, meta):
    return float(len(prompt) % 3)  # the response plays no part: every group is flat
"""


@pytest.mark.slow
def test_grpo_on_a_prompt_only_reward_warns_once_that_no_group_trains(
    ray_local, tmp_path, tiny_policy_dir, capfd
):
    from cluster.reporting.flat_groups import STEPS
    from cluster.reporting.metrics import read_metrics
    from cluster.train import main

    module = tmp_path / "prompt_only.py"
    module.write_text(PROMPT_ONLY)
    prompts = tmp_path / "prompts.jsonl"
    words = ["the movie was", "i loved it", "the plot is", "a film and", "the acting was", "it is very"]
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    tiny = SimpleNamespace(policy=tiny_policy_dir, prompts=prompts, reward=None)
    steps = STEPS + 2
    sets = {
        "data.prompts_per_step": 2,
        "rollout.chunk_size": 2,
        "rollout.sampling.n": 2,
        "rollout.sampling.max_new_tokens": 4,
        "learner.micro_batch_size": 4,
        "learner.advantage": "grpo",
        "reward.kind": "rule",
        "reward.functions": json.dumps([{"module": f"{module}:by_prompt"}]),
        "cluster.placement": "colocated",
    }
    run_dir = tmp_path / "run"
    argv = sum((["--set", s] for s in demo_overrides(tiny, steps, **sets)), [])
    assert main([str(CONFIG), "--run-dir", str(run_dir), *argv]) == 0

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "rollout/samples" in r]
    assert [r["rollout/flat_groups_frac"] for r in rows] == [1.0] * steps
    warnings = [line for line in capfd.readouterr().err.splitlines() if "consecutive steps" in line]
    assert warnings == [
        f"warning: every group's rewards were equal for {STEPS} consecutive steps (steps 1-{STEPS}, "
        "rollout/flat_groups_frac = 1): with learner.advantage='grpo' each sample's advantage is its reward "
        "minus its group's baseline, 0 here, so the policy gets no gradient. A reward that depends on the "
        "prompt only (not the response) does this, as does a task every sample solves or every sample fails: "
        "check the reward, or set data.dynamic_sampling.filter='nonzero_std' to train on the groups with a "
        "spread only."
    ]


def test_the_watch_counts_consecutive_flat_steps_only_for_group_estimators(capsys):
    from cluster.reporting.flat_groups import FlatGroupWatch

    watch = FlatGroupWatch("grpo", steps=2)
    for step, frac in enumerate([1.0, 0.5, 1.0, 1.0, 1.0, 1.0], start=1):
        watch.observe(step, {"rollout/flat_groups_frac": frac})
    assert capsys.readouterr().err.count("warning: every group's rewards were equal for 2") == 1
    gae = FlatGroupWatch("gae", steps=1)
    gae.observe(1, {"rollout/flat_groups_frac": 1.0})
    assert capsys.readouterr().err == ""
