"""Settings a run leaves unused are said at its start (issue 56, item 11): `cluster.train.preflight`, the
start of `python -m cluster.train`, on a real config, the tests' tiny policy and reward model and the
tests' multi-turn environment."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from demo_run import CONFIG, demo_overrides

ENV_MODULE = Path(__file__).resolve().parent / "multiturn_envs.py"


def _config(tmp_path, policy, reward, **extra):
    from cluster.config.schema import load_config

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in ["the movie was", "i loved it"]))
    tiny = SimpleNamespace(policy=policy, prompts=prompts, reward=reward)
    env = {
        "rollout.environment.name": "test-review",
        "rollout.environment.module": ENV_MODULE,
        "rollout.environment.max_total_tokens": 48,
        **extra,
    }
    return load_config(CONFIG, demo_overrides(tiny, 1, **env))


def test_an_environments_rewards_left_untrained_by_the_reward_kind_are_said_once_at_the_start(
    tmp_path, tiny_policy_dir, tiny_reward_dir, capsys
):
    from cluster.train import preflight

    preflight(_config(tmp_path, tiny_policy_dir, tiny_reward_dir))  # the demo's reward.kind: 'model'
    warnings = [line for line in capsys.readouterr().err.splitlines() if "rollout.environment.name" in line]
    assert warnings == [
        "warning: rollout.environment.name='test-review' with reward.kind='model': the environment's rewards "
        "(each turn's and the outcome) are NOT trained; each episode's reward is the reward.kind='model' score "
        "of its transcript alone. Set reward.kind='environment' to train on the environment's rewards."
    ]

    preflight(_config(tmp_path, tiny_policy_dir, tiny_reward_dir, **{"reward.kind": "environment"}))
    assert "rollout.environment.name" not in capsys.readouterr().err


def test_an_agents_rewards_left_untrained_by_the_reward_kind_are_said_at_the_start(tmp_path, tiny_policy_dir):
    from cluster.config.notices import config_notices
    from cluster.config.schema import load_config

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the movie was"}) + "\n")
    agent = Path(__file__).resolve().parent / "agent_files" / "calc_agents.py"
    sets = {
        "model.policy_path": tiny_policy_dir,
        "model.demo_assets": "null",
        "data.prompts_path": prompts,
        "agent.function": f"{agent}:tool_agent",
        "reward.kind": "rule",
        "reward.rule": "exact_match",
    }
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in sets.items()])
    (notice,) = [m for m in config_notices(cfg) if "agent sessions" in m]
    assert "the rewards the agent returns or reports are NOT trained" in notice
    assert not [
        m
        for m in config_notices(
            cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"kind": "environment"})})
        )
        if "agent sessions" in m
    ]
