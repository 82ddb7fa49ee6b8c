"""A second Ray cluster on this machine for tests that must not share the session's `ray_local`:
its own processes, ports and temp dir (a head, and nodes that join it as a user's do); reached by
address only and torn down by killing exactly its own process sessions, never with `ray stop`
(which would kill every Ray process on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_session(sid: int) -> None:
    """End every process of one session (Ray's workers get their own process group, not session)."""
    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(p.pid) == sid:
                procs[p.pid] = p
                procs.update({c.pid: c for c in p.children(recursive=True)})  # job drivers: own session
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(list(procs.values()), timeout=3)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


@dataclass
class RayHead:
    address: str  # GCS address, for RAY_ADDRESS / ray.init
    dashboard: str  # http://127.0.0.1:PORT (job and state APIs)
    temp_dir: Path
    env: dict[str, str]  # the environment the head was started with (drivers reuse it)


def ray_env() -> dict[str, str]:
    """This environment minus any Ray address, with this venv's bin first (jobs run its `python`)."""
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _ray_start(args: list[str], env: dict[str, str], cwd: str) -> int:
    """Run `ray start ARGS` in a session of its own (every process it starts inherits it); returns
    that session's id. Ray gives a raylet a fixed 30 s to register, which a loaded machine can
    miss: up to three tries."""
    cmd = [str(Path(sys.executable).parent / "ray"), "start", *args]
    errors: list[str] = []
    for _ in range(3):
        starter = subprocess.Popen(
            cmd, env=env, cwd=cwd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            out, _ = starter.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            starter.kill()
            out, _ = starter.communicate()
        if starter.returncode == 0:
            return starter.pid
        kill_session(starter.pid)
        errors.append(f"ray start failed ({starter.returncode}):\n{out.decode()[-3000:]}")
    raise RuntimeError("\n".join(errors))


def _wait_for_nodes(dashboard: str, count: int, timeout_s: float = 300.0) -> None:
    """Until the cluster lists `count` live nodes (asked over HTTP: no ray.init in this process)."""
    from ray.util.state import list_nodes

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):  # the state API answers once the dashboard is up
            alive = list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], timeout=30)
            if len(alive) >= count:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} live nodes after {timeout_s:.0f}s")
        time.sleep(1)


@contextlib.contextmanager
def ray_head(
    num_cpus: int = 2,
    env_vars: dict[str, str] | None = None,
    workers: Sequence[dict[str, Any]] = (),
    dashboard_port: int | None = None,
) -> Iterator[RayHead]:
    """`ray start --head` with the dashboard (on `dashboard_port`, else a free port), free ports and a
    temp dir of its own; then each of `workers` ({'num_cpus': .., 'resources': {..}}) joins it with
    `ray start --address` on this machine, as a user starts a multi-node cluster (joining nodes take the
    head's temp dir, Ray's default: every raylet shares one session folder)."""
    temp_dir = tempfile.mkdtemp(prefix="rpj", dir="/tmp")  # short: Ray's unix sockets live under it
    gcs, dashboard = free_port(), dashboard_port or free_port()
    env = {**ray_env(), **(env_vars or {})}
    head = [
        "--head",
        f"--port={gcs}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",  # default 52365 would clash with ray_local
        f"--metrics-export-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    sessions: list[int] = []
    try:
        try:
            sessions.append(_ray_start(head, env, temp_dir))
            for node in workers:
                args = [
                    f"--address=127.0.0.1:{gcs}",
                    f"--num-cpus={node.get('num_cpus', 1)}",
                    f"--resources={json.dumps(node.get('resources', {}))}",
                    f"--object-store-memory={128 * 2**20}",  # the demo's objects are small
                    f"--dashboard-agent-listen-port={free_port()}",
                    f"--metrics-export-port={free_port()}",
                    "--disable-usage-stats",
                ]
                sessions.append(_ray_start(args, env, temp_dir))
            if workers:
                _wait_for_nodes(f"http://127.0.0.1:{dashboard}", 1 + len(workers))
        except RuntimeError as err:
            pytest.fail(str(err))
        yield RayHead(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}", Path(temp_dir), env)
    finally:
        for sid in reversed(sessions):  # `ray start` led the session that each node's processes inherited
            kill_session(sid)
        shutil.rmtree(temp_dir, ignore_errors=True)
