"""Two runs on one machine: the dashboard port of a local Ray is held by another run's Ray (a real Ray
head of its own, `ray start --head --dashboard-port=8265`, as a first `make train` holds it).

A run that sets no port starts anyway, on the next free port, and says which; a run that sets the taken
port stops before Ray starts, with one line naming `cluster.dashboard_port`. Each run is a process of
its own (the session's `ray_local` would make `init_ray` connect to nothing new)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from ray_head import kill_session, ray_env, ray_head

from cluster.reporting.local_ray import DEFAULT_DASHBOARD_PORT

REPO = Path(__file__).resolve().parent.parent
START_S = 300  # a local Ray's start on a loaded 2-core machine

SECOND_RUN = """
import sys
from cluster.config.schema import load_config
from cluster.train import init_ray
url = init_ray(load_config(sys.argv[1]))
print(f"url {url}", flush=True)
sys.stdin.readline()  # the test has looked at its dashboard
"""


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _dashboard_answers(url: str) -> bool:
    """Whether a Ray dashboard serves `url` (its version, or 401 where Ray's token authentication is on)."""
    try:
        with urllib.request.urlopen(f"http://{url}/api/version", timeout=60) as answer:
            return "ray_version" in json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code == 401


@pytest.fixture(scope="module")
def port_8265_taken():
    """8265 held by a real Ray head of another 'run' (or by whatever holds it on this machine already)."""
    if not _bindable(DEFAULT_DASHBOARD_PORT):
        yield
        return
    with ray_head(num_cpus=1, dashboard_port=DEFAULT_DASHBOARD_PORT):
        assert not _bindable(DEFAULT_DASHBOARD_PORT)
        yield


def _config(tmp_path: Path, policy: Path, **cluster) -> Path:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in ["the film", "a movie"])
    )
    tree = {
        "model": {"policy_path": str(policy)},
        "data": {"prompts_path": str(prompts), "max_prompt_tokens": 16, "meta_keys": ["answer"]},
        "reward": {"kind": "rule", "rule": "exact_match"},
        "cluster": {"num_cpus": 2, **cluster},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_a_run_that_sets_the_taken_port_stops_before_ray_with_one_line(
    port_8265_taken, tiny_policy_dir, tmp_path
):
    cfg = _config(tmp_path, tiny_policy_dir, dashboard_port=DEFAULT_DASHBOARD_PORT)
    run = subprocess.run(
        [sys.executable, "-m", "cluster.train", str(cfg), "--run-dir", str(tmp_path / "run")],
        cwd=REPO,
        env=ray_env(),
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    want = (
        "error: cluster.dashboard_port: 127.0.0.1:8265 is taken (another run's Ray dashboard?): set "
        "cluster.dashboard_port to a free port, leave it unset (the next free port from 8265 is taken and "
        "printed), or set cluster.dashboard: false"
    )
    assert run.stderr.strip().splitlines()[-1] == want
    assert "Traceback" not in run.stderr and "Failed to bind" not in run.stderr
    assert "Started a local Ray" not in run.stdout + run.stderr and "ray dashboard" not in run.stdout


def test_a_run_that_sets_no_port_starts_on_the_next_free_one_and_says_so(
    port_8265_taken, tiny_policy_dir, tmp_path
):
    cfg = _config(tmp_path, tiny_policy_dir)
    second = subprocess.Popen(
        [sys.executable, "-c", SECOND_RUN, str(cfg)],
        cwd=REPO,
        env=ray_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + START_S
        while not (lines and lines[-1].startswith("url ")):  # each line is an event the run prints
            line = second.stdout.readline()
            assert line, f"the second run ended before its Ray was up: {lines}"
            assert time.monotonic() < deadline
            lines.append(line.strip())
        url = lines[-1].removeprefix("url ")
        port = int(url.rsplit(":", 1)[1])
        assert port != DEFAULT_DASHBOARD_PORT
        assert (
            f"ray dashboard: port 8265 is taken (another run's Ray?): this run's dashboard is on port {port} "
            "(cluster.dashboard_port sets one)"
        ) in lines
        assert _dashboard_answers(url)
    finally:
        with contextlib.suppress(OSError):
            second.stdin.close()  # the run ends: its Ray shuts down with it
        try:
            second.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_session(second.pid)  # the driver and the Ray it started
