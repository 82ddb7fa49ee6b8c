"""Episodes played by an agent outside the cluster (`agent.runners: external`): a rollout worker offers
its sessions on its gateway, and `python -m agent_runners.external`, a separate process that only speaks
HTTP, claims them (`POST /sessions/claim`), plays them with the user's agent, reports rewards and ends
them; the worker's generate call returns them as samples. Also: what nobody claims fails, named; the
claim route's refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from scripted_models import scripted_policy

from agent_runners.config import AgentConfig
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.gateway.claims import ExternalAgents
from rollout_workers.worker import RolloutWorker

AGENTS = Path(__file__).parent / "agent_files" / "calc_agents.py"
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return scripted_policy(tmp_path_factory.mktemp("scripted"))


def external_worker(policy, timeout_s: float = 120.0) -> RolloutWorker:
    config = RolloutConfig(sampling=SamplingConfig(max_new_tokens=20, n=2))
    return RolloutWorker(policy[0], config, agents=ExternalAgents(timeout_s, False, "policy"))


def generate(worker, answers) -> list:
    rows = [[{"role": "user", "content": "12*34="}] for _ in answers]
    ids = [np.arange(3, 8) for _ in answers]
    return worker.generate(
        list(range(len(answers))), ids, seed=0, metas=[{"answer": a} for a in answers], messages=rows
    )


def book(path: Path, worker: RolloutWorker, ended: bool = False) -> Path:
    info = worker.start_gateway("policy")
    entry = {"worker": "rollout-worker-0", **info}
    path.write_text(json.dumps({"run": "t", "model": "policy", "ended": ended, "gateways": [entry]}))
    return path


def test_an_agent_in_another_process_claims_plays_and_ends_the_workers_sessions(policy, tmp_path):
    worker = external_worker(policy)
    gateways = book(tmp_path / "gateways.json", worker)
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent_runners.external", "--gateways", str(gateways),
         "--agent", f"{AGENTS}:tool_agent", "--sessions", "4", "--episodes", "4"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        samples = generate(worker, ("408", "999"))
        out, _ = agent.communicate(timeout=120)
    finally:
        agent.kill()
        worker._gateway.close()
    assert agent.returncode == 0, out
    assert "played 4 episodes {'done': 4}" in out
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [s.episode.outcome for s in samples] == [1.0, 1.0, 0.0, 0.0]  # the agent's own rewards
    assert [s.episode.turns for s in samples] == [1, 1, 2, 2]
    assert worker.stats()["agent_done"] == 4
    assert worker._gateway.gateway.stats()["claimed"] == 4


def test_sessions_nobody_claims_fail_by_name_and_are_withdrawn(policy):
    worker = external_worker(policy, timeout_s=1.0)
    try:
        with pytest.raises(RuntimeError, match="no external agent claimed it within agent.timeout_s=1s"):
            generate(worker, ("408",))
        gateway = worker._gateway.gateway
        assert len(gateway.offers) == 0 and gateway.stats()["open_sessions"] == 0
    finally:
        worker._gateway.close()


def test_the_claim_route_wants_the_admin_key_and_says_when_nothing_is_offered(policy):
    worker = external_worker(policy)
    try:
        info = worker.start_gateway("policy")
        claim = info["url"] + "/sessions/claim"
        assert httpx.post(claim, headers={"Authorization": "Bearer nope"}, json={}).status_code == 401
        admin = {"Authorization": f"Bearer {info['admin_key']}"}
        idle = httpx.post(claim, headers=admin, json={"wait_s": 0.1})
        assert idle.status_code == 204 and idle.headers["retry-after"] == "1"
        bad = httpx.post(claim, headers=admin, json={"wait_s": 600})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "wait_s"
        # an offer appears while a claim waits for it
        got: list = []
        waiting = threading.Thread(
            target=lambda: got.append(httpx.post(claim, headers=admin, json={"wait_s": 30}, timeout=60))
        )
        waiting.start()
        session = worker._gateway.gateway.open_session(7, 1, 30.0)
        from kernel.agent_records import AgentTask

        task = AgentTask(
            session.id, session.key, info["url"] + "/v1", "policy", {"answer": np.int64(3)}, 30.0
        )
        worker._gateway.gateway.offers.offer([task])
        waiting.join(timeout=60)
        body = got[0].json()
        assert body["session_id"] == session.id and body["row"] == {"answer": 3}  # numpy as its value
    finally:
        worker._gateway.close()


def test_external_runners_take_no_function_and_start_no_actors():
    assert AgentConfig(runners="external").enabled and AgentConfig(runners="external").actors == 0
    with pytest.raises(ValueError, match="agent.runners='external' with agent.function"):
        AgentConfig(runners="external", function="a.py:f")
