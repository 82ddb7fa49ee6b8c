"""A rollout worker's generate call as agent episodes: one gateway session per sample, played by the
agent runners (a role of their own, reached through `agents`), captured token for token by the
worker's gateway (`rollout_workers.gateway`).

For each prompt and each of its n samples the worker opens a session on its own gateway (so the
session's calls run on its engine, batched with every other session's) and hands the runners an
`AgentTask`: the session's base URL and key, and the prompt row. When the runners answer, each session
is ended with its outcome: a reward the agent returned is the session's (unless one was reported over
HTTP first); a failed or timed-out agent, or a runner that died, fails the session, and its segments
are then dropped downstream as failed episodes (counted, never trained) unless `agent.train_failed`.
A session is one sample, or several when the agent broke its history (`Session.prepare`); a session
that made no call yields none (counted: `agent_no_calls`). When no session of a call reached the model
(an agent that cannot run, runners that cannot be reached) the call raises, naming the first error:
nothing to train on is a fault, not an empty batch.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Protocol

from kernel.agent_records import AgentOutcome, AgentTask
from rollout_workers.gateway.gateway import Gateway
from rollout_workers.gateway.protocol import GatewayError
from rollout_workers.types import Sample


class Agents(Protocol):
    """Who plays the episodes, as the worker sees them: play these tasks (sessions open on `gateway`), one
    outcome each, in order. The runner actors (`cluster.placement.agents.RemoteAgents`), or agents outside
    the cluster that claim them over HTTP (`rollout_workers.gateway.claims.ExternalAgents`)."""

    timeout_s: float
    train_failed: bool
    model_name: str

    def run(self, tasks: list[AgentTask], gateway: Gateway) -> list[AgentOutcome]: ...


def play(
    gateway: Gateway,
    base_url: str,
    agents: Agents,
    prompt_indices: list[int],
    rows: list[dict[str, Any]],
    n: int,
    counts: collections.Counter,
) -> list[Sample]:
    """Every prompt's n episodes, played; their samples (prompt order, then sample index)."""
    sessions, tasks = [], []
    for index, row in zip(prompt_indices, rows, strict=True):
        for k in range(n):
            session = gateway.open_session(int(index), k, agents.timeout_s)
            sessions.append(session)
            tasks.append(
                AgentTask(session.id, session.key, base_url + "/v1", gateway.model, row, agents.timeout_s)
            )
    try:
        outcomes = agents.run(tasks, gateway)
    except Exception as error:  # the runners could not be reached: every session fails
        outcomes = [AgentOutcome(t.session_id, "failed", None, f"agent runners: {error!r}") for t in tasks]
    for session, outcome in zip(sessions, outcomes, strict=True):
        reward = (
            outcome.reward if outcome.status == "done" or not agents.train_failed else (outcome.reward or 0.0)
        )
        if session.ended is None and session.reward is None and reward is not None:
            with contextlib.suppress(GatewayError):  # past its deadline: it ends as timed out
                session.set_reward(reward)
        session.end(outcome.status, outcome.error)
        counts[f"agent_{outcome.status}"] += 1
        counts["agent_no_calls"] += not session.segments
    silent = [o for s, o in zip(sessions, outcomes, strict=True) if o.status != "done" and not s.segments]
    if silent and len(silent) == len(sessions):  # nothing reached the model: a broken agent or runner
        gateway.take([s.id for s in sessions])
        raise RuntimeError(
            f"all {len(sessions)} agent sessions of this call failed before calling the model; the first: "
            f"{silent[0].status}: {silent[0].error}"
        )
    samples = gateway.take([s.id for s in sessions])
    if agents.train_failed:
        for sample in samples:
            if sample.episode is not None and sample.episode.failed:
                sample.episode.status = "done"
    return samples
