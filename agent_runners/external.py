"""Play a run's episodes from outside the cluster, over HTTP only (`agent.runners: external`):

    python -m agent_runners.external --gateways runs/NAME/gateways.json --agent my_agent.py:agent

An agent anywhere that reaches the workers' gateways claims an episode (`POST /sessions/claim` with a
gateway's admin key: the session's id, key, base URL and prompt row), plays it with an openai client
pointed at the session, reports its reward and ends it (`/sessions/{id}/reward`, `/sessions/{id}/end`).
This module is that loop for an agent function of the runners' shape (`agent_runners.runner`), at most
`--sessions` at once; an agent in another language does the same four calls.

The gateways are read from the run folder's `gateways.json` (`cluster.placement.gateway_book`), again on
every round, so workers that a scale-up or a replacement adds are found; one that refuses connections is
skipped. It waits for the file while the run starts, and stops when the file says the run ended, when
`--episodes` are claimed, or when no listed gateway has answered for `--idle-exit-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agent_runners.config import AgentConfig
from agent_runners.runner import AgentRunner
from kernel.agent_records import AgentTask

CLAIM_WAIT_S = 1.0  # each claim waits this long on its gateway for an episode to be offered


@dataclass
class Played:
    """What the loop did: episodes by outcome, and why it stopped."""

    outcomes: dict[str, int] = field(default_factory=dict)
    stopped: str = ""

    @property
    def episodes(self) -> int:
        return sum(self.outcomes.values())


def read_gateways(path: Path) -> tuple[list[dict], bool]:
    """The listed gateways and whether the run ended ([] and False while the file is not written yet)."""
    try:
        book = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [], False
    return list(book["gateways"]), bool(book["ended"])


async def claim(http: httpx.AsyncClient, gateway: dict) -> AgentTask | None:
    """One offered episode of `gateway`, or None (none offered within CLAIM_WAIT_S)."""
    answer = await http.post(
        gateway["url"] + "/sessions/claim",
        headers={"Authorization": f"Bearer {gateway['admin_key']}"},
        json={"wait_s": CLAIM_WAIT_S},
        timeout=CLAIM_WAIT_S + 30.0,
    )
    if answer.status_code == 204:
        return None
    answer.raise_for_status()
    return AgentTask(**answer.json())


async def play_external(
    gateways: Path,
    function: str,
    sessions: int = 32,
    episodes: int | None = None,
    idle_exit_s: float = 60.0,
) -> Played:
    """Claim and play episodes from the run's gateways until the run ends (see the module)."""
    runner = AgentRunner(AgentConfig(function=function, sessions_per_runner=sessions))
    played, turn = Played(), itertools.count()
    last_answer = time.monotonic()
    reserved = 0  # episodes claimed or being claimed (one event loop: no lock needed)

    async def slot(http: httpx.AsyncClient) -> None:
        nonlocal last_answer, reserved
        while not played.stopped:
            if episodes is not None and reserved >= episodes:
                return
            listed, ended = read_gateways(gateways)
            if ended:
                played.stopped = "the run ended"
                return
            if time.monotonic() - last_answer > idle_exit_s:
                played.stopped = f"no gateway answered for {idle_exit_s:g}s"
                return
            if not listed:  # the run is still starting: its gateways are not up yet
                last_answer = time.monotonic()
                await asyncio.sleep(CLAIM_WAIT_S)
                continue
            gateway = listed[next(turn) % len(listed)]
            reserved += 1
            try:
                task = await claim(http, gateway)
            except httpx.TransportError:  # a worker that is gone (scaled down, replaced): the next one
                reserved -= 1
                await asyncio.sleep(CLAIM_WAIT_S / len(listed))
                continue
            last_answer = time.monotonic()
            if task is None:
                reserved -= 1
                continue
            outcome = await runner.play(task)
            played.outcomes[outcome.status] = played.outcomes.get(outcome.status, 0) + 1

    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(slot(http) for _ in range(sessions)))
    played.stopped = played.stopped or f"{episodes} episodes played"
    return played


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateways", type=Path, required=True, help="the run folder's gateways.json")
    parser.add_argument("--agent", required=True, help="'path/to/agent.py:function' or 'module:function'")
    parser.add_argument("--sessions", type=int, default=32, help="episodes played at once")
    parser.add_argument("--episodes", type=int, default=None, help="claim no more than this many")
    parser.add_argument("--idle-exit-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    played = asyncio.run(
        play_external(args.gateways, args.agent, args.sessions, args.episodes, args.idle_exit_s)
    )
    print(f"played {played.episodes} episodes {played.outcomes}; stopped: {played.stopped}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
