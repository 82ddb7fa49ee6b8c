"""The agent section's rules: each refusal names the field and what to do."""

from __future__ import annotations

import pytest
from test_config import tree

from cluster.config.schema import ConfigError, build_config

AGENT = {"function": "my_agent.py:agent"}


def test_an_agent_run_is_multi_turn_and_takes_the_sessions_reward():
    cfg = build_config(
        tree(agent=AGENT, reward={"kind": "environment"}, rollout={"gateway": {"max_total_tokens": 256}})
    )
    assert cfg.episodes and cfg.longest_episode == 256


def test_an_agent_runs_horizon_loss_normalises_by_its_longest_session():
    """Dr. GRPO's constant (learner.loss_norm_tokens), resolved for agent sessions: the gateway's limit."""
    learner = {"loss_agg": "seq-mean-token-sum-norm", "advantage": "grpo", "grpo": {"norm_adv_by_std": False}}
    cfg = build_config(
        tree(
            agent=AGENT,
            reward={"kind": "environment"},
            rollout={"gateway": {"max_total_tokens": 256}, "sampling": {"n": 2}},
            learner=learner,
        )
    )
    assert cfg.resolved.loss_norm_tokens == cfg.resolved.learner.loss_norm_tokens == 256
    assert cfg.learner.loss_norm_tokens is None


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"agent": {"function": "my_agent.py"}}, r"agent\.function.*'path/to/agent\.py:function'"),
        ({"agent": {**AGENT, "num_runners": 0}}, r"agent\.num_runners"),
        (
            {"agent": AGENT, "rollout": {"environment": {"name": "tools"}}},
            "rollout.environment.name and agent.function both set",
        ),
        (
            {"agent": AGENT, "pipeline": {"mode": "async", "partial_rollout": True, "max_staleness": 1}},
            "partial_rollout=true with agent.function",
        ),
        ({"agent": AGENT, "data": {"max_prompt_tokens": 600}}, r"rollout\.gateway\.max_total_tokens=512"),
        ({"reward": {"kind": "environment"}}, "rollout.environment.name, agent.function or agent.runners"),
        ({"rollout": {"gateway": {"on_history_break": "merge"}}}, r"rollout\.gateway\.on_history_break"),
    ],
)
def test_the_agent_rules_name_their_fields(sections, message):
    with pytest.raises(ConfigError, match=message):
        build_config(tree(**sections))


def test_cluster_scale_takes_the_agent_runners_in_either_placement():
    from cluster.pipeline.control import RunControl
    from cluster.scale import parse_assignments

    assert parse_assignments(["agent=3", "rollout=2"]) == {"agent": 3, "rollout": 2}
    colocated = RunControl({"rollout": 1, "agent": 1}, fixed="colocated: counts are fixed")
    assert colocated.set_target("agent", 3)["agent"] == 3  # beside the plan: scalable in any placement
    with pytest.raises(ValueError, match="colocated"):
        colocated.set_target("rollout", 2)
    with pytest.raises(ValueError, match="agent runners run only with agent.function"):
        RunControl({"rollout": 1}).set_target("agent", 2)
