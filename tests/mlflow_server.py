"""A real MLflow tracking server for tests: SQLite backend store, artifacts served by the server, on
127.0.0.1 at a free port. Started by the fixture that needs it, stopped (its own process group) after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder: Path, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """The server process and its URL, once /health answers."""
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(mlflow),
        "server",
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.sqlite'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {(folder / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise RuntimeError(
        f"mlflow server not healthy after {timeout} s: {(folder / 'server.log').read_text()[-2000:]}"
    )


def stop(proc: subprocess.Popen) -> None:
    """End the server and the workers it started (its own session's process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
