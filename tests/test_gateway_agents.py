"""A rollout worker whose samples are agent sessions: the real AgentRunner plays the user's agent (tests/
agent_files/calc_agents.py, only the openai client) against the worker's gateway, and the worker returns the
sessions as samples. Failures (an agent that raises, hangs past its deadline, returns a non-number)
fail the session: its sample is a failed episode, dropped downstream, unless agent.train_failed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from scripted_models import scripted_policy

from agent_runners.config import AgentConfig
from agent_runners.runner import AgentRunner
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.worker import RolloutWorker

AGENTS = Path(__file__).parent / "agent_files" / "calc_agents.py"


class InProcess:
    """The runners as the worker sees them (`rollout_workers.agent_sessions.Agents`), one real AgentRunner
    in this process (the cluster's are Ray actors: cluster/placement/agents.py)."""

    def __init__(self, function: str, file: Path = AGENTS, **fields) -> None:
        self.config = AgentConfig(function=f"{file}:{function}", **fields)
        self.runner = AgentRunner(self.config)
        self.timeout_s, self.train_failed, self.model_name = (
            self.config.timeout_s,
            self.config.train_failed,
            self.config.model_name,
        )

    def run(self, tasks, gateway=None):
        return asyncio.run(self.runner.run(tasks))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return scripted_policy(tmp_path_factory.mktemp("scripted"))


def worker_with(policy, agents) -> RolloutWorker:
    return RolloutWorker(
        policy[0], RolloutConfig(sampling=SamplingConfig(max_new_tokens=20, n=2)), agents=agents
    )


def play(worker, answers=("408", "999")) -> list:
    rows = [[{"role": "user", "content": "12*34="}] for _ in answers]
    ids = [np.arange(3, 8) for _ in answers]  # the worker validates ids; the agent sees the messages
    return worker.generate(
        list(range(len(answers))), ids, seed=0, metas=[{"answer": a} for a in answers], messages=rows
    )


def test_the_users_agent_plays_sessions_that_become_samples_with_its_reward(policy):
    worker = worker_with(policy, InProcess("tool_agent"))
    try:
        samples = play(worker)
        assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [s.episode.outcome for s in samples] == [1.0, 1.0, 0.0, 0.0]
        # the agent that got 999 called twice: one sample of two completions, the tool result between masked
        assert [s.episode.turns for s in samples] == [1, 1, 2, 2]
        assert all(s.episode.status == "done" for s in samples)
        stats = worker.stats()
        assert stats["agent_done"] == 4 and stats["agent_no_calls"] == 0
    finally:
        worker._gateway.close()


def test_a_plain_def_agent_runs_in_a_thread_with_a_sync_client(policy):
    worker = worker_with(policy, InProcess("sync_agent"))
    try:
        assert [s.episode.outcome for s in play(worker, ("408",))] == [1.0, 1.0]
    finally:
        worker._gateway.close()


@pytest.mark.parametrize(
    ("function", "status", "error"),
    [
        ("raising_agent", "env_error", "RuntimeError: the agent's own bug"),
        ("hanging_agent", "env_timeout", "ran past 2s"),
        ("wrong_return", "env_error", "the agent returned 'yes'"),
    ],
)
def test_a_failed_agent_fails_its_session_which_is_dropped_unless_configured(policy, function, status, error):
    worker = worker_with(policy, InProcess(function, timeout_s=2.0))
    try:
        samples = play(worker, ("408",))
        assert [s.episode.status for s in samples] == [status, status]
        assert all(error in s.episode.error for s in samples)
        assert worker.stats()[f"agent_{'timeout' if status == 'env_timeout' else 'failed'}"] == 2
    finally:
        worker._gateway.close()
    trained = worker_with(policy, InProcess(function, timeout_s=2.0, train_failed=True))
    try:
        samples = play(trained, ("408",))
        assert [(s.episode.status, s.episode.outcome) for s in samples] == [("done", 0.0), ("done", 0.0)]
    finally:
        trained._gateway.close()


def test_an_openai_agents_sdk_agent_runs_its_tool_loop_as_one_session(policy):
    """The Agents SDK (function_tool, chat-completions model, its own tool loop) against the gateway:
    the scripted policy calls the calculator every turn, so the SDK runs it, sends the result back, and
    stops at its max_turns; the session is one sample of three completions with the tool messages masked."""
    worker = worker_with(policy, InProcess("agent", AGENTS.parent / "sdk_agent.py"))
    try:
        samples = play(worker, ("408",))
        for s in samples:
            assert s.episode.status == "done" and s.episode.turns == 3
            assert s.episode.info.get("history_breaks_history", 0) == 0
            tok = worker._gateway.gateway.tokenizer
            assert tok.decode(s.response_ids[s.episode.loss_mask == 0]).count("<|im_start|>tool\n408") == 2
    finally:
        worker._gateway.close()


@pytest.mark.slow
def test_a_runner_killed_mid_session_fails_its_sessions_and_is_restarted(ray_local, policy):
    """Runner actors on a real Ray: the runner is killed once every session has made its call (the
    gateway's own record says so); the worker's generate call returns their samples as failed episodes
    naming the dead runner, and the next call plays on the runner Ray restarted."""
    import threading

    from cluster.placement.agents import RemoteAgents, runner_up, shipped, start_agent_runners

    config = shipped(AgentConfig(function=f"{AGENTS}:calls_then_waits", timeout_s=60, num_cpus=0))
    runners = start_agent_runners(config, lambda i: f"test-agent-runner-{i}")
    worker = worker_with(policy, RemoteAgents(runners, config))
    try:
        out: list = []
        call = threading.Thread(target=lambda: out.extend(play(worker, ("408",))))
        call.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # both sessions have their completion recorded
            if worker._gateway is not None:
                live = list(worker._gateway.gateway.sessions.values())
                if len(live) == 2 and all(s.segments for s in live):
                    break
            time.sleep(0.05)
        ray_local.kill(runners[0], no_restart=False)
        call.join(timeout=120)
        assert [s.episode.status for s in out] == ["env_error", "env_error"]
        assert all("agent runner died" in s.episode.error for s in out)
        assert worker.stats()["agent_failed"] == 2
        assert runner_up(runners[0])  # restarted by Ray: the runners' own readiness wait says so
    finally:
        worker._gateway.close()
        for r in runners:
            ray_local.kill(r, no_restart=True)


@pytest.mark.slow
def test_the_agent_runners_scale_and_the_workers_follow(ray_local, policy):
    """`cluster.scale agent=K` resizes the runner group: a grown group's new runner plays the worker's next
    call's sessions beside the first; a shrunk group's runner leaves once its calls are played (Ray says
    the actor is dead) and the worker's next call plays on the runners left."""
    from cluster.placement.agents import AgentRunners, shipped

    config = shipped(AgentConfig(function=f"{AGENTS}:tool_agent", num_cpus=0))
    group = AgentRunners(config, lambda i: f"test-scaled-runner-{i}", 120)
    rollout = RolloutConfig(sampling=SamplingConfig(max_new_tokens=20, n=2))
    worker = ray_local.remote(RolloutWorker).remote(policy[0], rollout, 0, 0, None, group.view())

    def call(answers=("408", "999", "408", "999")) -> list:
        rows = [[{"role": "user", "content": "12*34="}] for _ in answers]
        ids = [np.arange(3, 8) for _ in answers]
        metas = [{"answer": a} for a in answers]
        ref = worker.generate.remote(list(range(len(answers))), ids, 0, None, None, metas, rows)
        return ray_local.get(ref, timeout=300)

    def played(runner) -> int:
        return ray_local.get(runner.stats.remote(), timeout=60)["done"]

    try:
        assert len(call()) == 8 and played(group.runners[0]) == 8
        assert group.resize(2, [worker]) == ["+test-scaled-runner-1"]
        assert all(s.episode.status == "done" for s in call())
        first, second = group.runners
        assert (played(first), played(second)) == (12, 4)  # 8 tasks dealt in two slices of 4
        assert group.resize(1, [worker]) == ["-test-scaled-runner-1"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # retired once its calls are done, then stopped
            try:
                ray_local.get(second.ping.remote(), timeout=30)
            except ray_local.exceptions.RayActorError:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the runner scaled away is still alive")
        assert len(call()) == 8 and played(first) == 20
    finally:
        ray_local.kill(worker)
        for r in group.runners:
            ray_local.kill(r, no_restart=True)
