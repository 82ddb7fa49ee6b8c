"""The Tinker-API service submitted as a Ray job (`python -m cluster.serve.submit`), as a run is
(tests/test_submit.py): to a real `ray start --head` with its dashboard and a second node joined on this
machine, as a user starts a cluster. The two raylets share one session folder, so the service's driver
hands its working dir in place (`cluster.reporting.job_env`), and its tenant actor runs on the joined
node (the head has no CPUs). Once the job's log says `serving <url>`, the real SDK (.venv-tinker) trains
through it; the Jobs view shows the job RUNNING with its metadata; `ray job stop` ends it and its tenant.
A bad config exits 2 before anything is contacted; a `local` Ray inside a job is refused."""

from __future__ import annotations

import asyncio
import re
import secrets
import shlex
import time
from pathlib import Path

import pytest
import yaml
from ray_head import ray_head as start_ray_head
from test_submit import _silent_server
from test_tinker_service import KEY, MODEL, needs_sdk, run_client

from cluster.reporting.job_env import JOB_CONFIG_VAR
from cluster.serve.ray_address import ray_address
from cluster.serve.submit import build_entrypoint, load_checked, main, relative_path_warnings
from cluster.submit import EXIT_BAD_INPUT, REPO_ROOT, connect


@pytest.fixture
def repo_config():
    """Writes a service config inside the uploaded repo (the job reads it from its working dir);
    removed after the test."""
    made: list[Path] = []

    def write(config: dict) -> str:
        path = REPO_ROOT / "tests" / f".serve_job_{secrets.token_hex(3)}.yaml"
        path.write_text(yaml.safe_dump(config))
        made.append(path)
        return str(path)

    yield write
    for path in made:
        path.unlink(missing_ok=True)


def _log_line(client, job_id: str, prefix: str, timeout_s: float = 900.0) -> tuple[str, str]:
    """The first line of the job's log starting with `prefix`, as the log is written (and the log up
    to it); fails with the log when the job ends without one."""
    seen: list[str] = []

    async def scan() -> str | None:
        rest = ""
        async for chunk in client.tail_job_logs(job_id):
            *lines, rest = (rest + chunk).split("\n")
            for line in lines:
                seen.append(line)
                if line.startswith(prefix):
                    return line
        return None

    line = asyncio.run(asyncio.wait_for(scan(), timeout_s))
    assert line is not None, f"{client.get_job_status(job_id)}:\n" + "\n".join(seen[-80:])
    return line, "\n".join(seen)


def _tenants(dashboard: str) -> list:
    from ray.util.state import list_actors

    return list_actors(address=dashboard, filters=[("class_name", "=", "TenantModel")], timeout=60)


@pytest.mark.slow
@needs_sdk
@pytest.mark.timeout(1800)  # two nodes, the service's and its tenant's start-up on a shared 2-core machine
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")  # inside Ray's job SDK
def test_the_service_runs_as_a_ray_job_serves_the_sdk_and_ray_job_stop_ends_it(
    tiny_policy_dir, repo_config, capsys
):
    from ray.util.state import list_nodes

    config = repo_config(
        {
            "port": 0,
            "api_keys": [KEY],
            "base_models": [{"name": MODEL, "path": str(tiny_policy_dir)}],
            "lora_alpha": 8.0,
            "tenant_cpus": 1.0,
        }
    )
    on_cluster = Path(config).relative_to(REPO_ROOT).as_posix()
    # token auth off on every node (a joining node cannot register otherwise: tests/test_submit.py)
    no_auth = {"RAY_AUTH_MODE": "disabled"}
    with start_ray_head(num_cpus=0, env_vars=no_auth, workers=[{"num_cpus": 1}]) as head:
        assert main(["--address", head.dashboard, config, "--no-wait"]) == 0
        out = capsys.readouterr().out
        job_id = re.search(r"submitted job (\S+) to ", out).group(1)
        assert re.fullmatch(r"serve-[0-9a-f]{6}", job_id)
        assert f"  dashboard: {head.dashboard}/#/jobs/{job_id}" in out
        assert f"  stop:      ray job stop --address {head.dashboard} {job_id}" in out

        client = connect(head.dashboard)
        serving, log = _log_line(client, job_id, "serving ")
        url = serving.split()[1]
        assert "job working dir used in place by this machine's raylets" in log  # two raylets, one session
        info = client.get_job_info(job_id)
        assert str(info.status) == "RUNNING"
        assert info.metadata == {
            "rayppo_service": job_id,
            "rayppo_config": on_cluster,
            "rayppo_base_models": MODEL,
        }
        assert shlex.split(info.entrypoint) == build_entrypoint_args(on_cluster)

        trained = run_client("train", url)
        assert trained["after_loss"] < trained["first_loss"] - 0.1  # the SDK trained through the job
        assert str(client.get_job_status(job_id)) == "RUNNING"
        model_id = trained["info"]["model_id"]
        assert f"tenant {model_id} ({MODEL}" in client.get_job_logs(job_id)
        [head_node] = [n.node_id for n in list_nodes(address=head.dashboard, timeout=60) if n.is_head_node]
        tenants = _tenants(head.dashboard)
        assert [t.state for t in tenants] == ["ALIVE"]  # its session lives on (session_timeout_s)
        assert tenants[0].node_id != head_node  # on the joined node, from the job's working dir

        assert client.stop_job(job_id)
        deadline = time.monotonic() + 600
        while not client.get_job_status(job_id).is_terminal():
            assert time.monotonic() < deadline, "the stopped service did not end in time"
            time.sleep(1)  # the poll's pace, not a synchronisation
        assert str(client.get_job_status(job_id)) == "STOPPED"
        while any(t.state != "DEAD" for t in _tenants(head.dashboard)):  # the job's actors end with it
            assert time.monotonic() < deadline, f"tenants outlived the job: {_tenants(head.dashboard)}"
            time.sleep(1)


def build_entrypoint_args(config: str) -> list[str]:
    return ["python", "-m", "cluster.serve", config, "--ray-address", "auto"]


def test_the_entrypoint_joins_the_jobs_cluster_and_quotes_the_config():
    assert shlex.split(build_entrypoint("configs/my serve.yaml")) == build_entrypoint_args(
        "configs/my serve.yaml"
    )


def _valid(tmp_path: Path, **more) -> dict:
    return {"api_keys": ["tml-k"], "base_models": [{"name": "m", "path": str(tmp_path)}], **more}


def test_a_bad_service_config_exits_2_naming_the_field_before_contacting_the_cluster(
    tmp_path, repo_config, capsys
):
    outside = tmp_path / "serve.yaml"
    outside.write_text(yaml.safe_dump(_valid(tmp_path)))
    with _silent_server() as srv:
        address = f"http://127.0.0.1:{srv.getsockname()[1]}"
        bad_port = repo_config(_valid(tmp_path, port=70000))
        assert main(["--address", address, bad_port]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert "port" in err and "65535" in err
        other_cluster = repo_config(_valid(tmp_path, ray_address="10.0.0.1:6379"))
        assert main(["--address", address, other_cluster]) == EXIT_BAD_INPUT
        assert "ray_address: '10.0.0.1:6379' names a cluster to join" in capsys.readouterr().err
        assert main(["--address", address, str(outside)]) == EXIT_BAD_INPUT
        assert "outside the uploaded working dir" in capsys.readouterr().err
        assert main(["--address", address, str(tmp_path / "none.yaml")]) == EXIT_BAD_INPUT
        assert "none.yaml" in capsys.readouterr().err
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody connected


def test_a_local_ray_is_refused_inside_a_job_and_auto_joins_the_jobs():
    """`cluster.serve.ray_address`: the address given to ray.init, by config, override and whether this
    process runs as a Ray job."""
    assert ray_address("local", None, in_job=False) == "local"  # `make serve`: a Ray of its own
    assert ray_address("auto", None, in_job=True) == "auto"
    assert ray_address("local", "auto", in_job=True) == "auto"  # cluster.serve.submit's entrypoint
    assert ray_address("10.0.0.1:6379", None, in_job=True) == "10.0.0.1:6379"
    assert ray_address("10.0.0.1:6379", "10.0.0.1:6379", in_job=False) == "10.0.0.1:6379"
    with pytest.raises(ValueError, match="ray_address: 'local' starts a Ray cluster of its own"):
        ray_address("local", None, in_job=True)
    with pytest.raises(ValueError, match="ray_address: 'local' starts a Ray cluster of its own"):
        ray_address("auto", "local", in_job=True)
    with pytest.raises(ValueError, match="ray_address: '10.0.0.1:6379' names a cluster to join"):
        ray_address("10.0.0.1:6379", "auto", in_job=True)


def test_cluster_serve_run_as_a_job_with_a_local_ray_exits_2_before_starting_one(
    tmp_path, monkeypatch, capsys
):
    from cluster.serve.__main__ import main as serve_main

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump(_valid(tmp_path)))
    monkeypatch.setenv(JOB_CONFIG_VAR, "{}")  # as Ray's job supervisor sets it for the entrypoint
    assert serve_main([str(cfg)]) == 2
    assert "a second cluster beside the job's" in capsys.readouterr().err


def test_relative_paths_of_a_submitted_config_are_named_in_warnings():
    tiny = REPO_ROOT / "configs" / "serve" / "tiny.yaml"
    warnings = relative_path_warnings(load_checked(tiny), REPO_ROOT)
    assert [w.split("=")[0] for w in warnings] == ["warning: base_models[0].path", "warning: checkpoint_dir"]
    assert relative_path_warnings(load_checked(tiny), None) == []  # --no-working-dir: paths on the cluster
