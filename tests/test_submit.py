"""Job submission against a real Ray head (its own processes, ports and temp dir, `ray_head.py`;
reached over HTTP only, no `ray.init` here) and a 3-node cluster started with `ray start`, and the
examples."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import socket
from pathlib import Path

import pytest
import yaml
from ray_head import free_port
from ray_head import ray_head as start_ray_head

from cluster.config.schema import load_config
from cluster.reporting.job_env import (
    JOB_CONFIG_VAR,
    SharedSessionError,
    check_every_node_shares,
    in_place_working_dir,
)
from cluster.submit import (
    DEFAULT_EXCLUDES,
    EXIT_BAD_INPUT,
    EXIT_JOB_FAILED,
    EXIT_UNREACHABLE,
    REPO_ROOT,
    build_entrypoint,
    connect,
    follow,
    main,
    submit,
    submit_training,
)

EXAMPLES = REPO_ROOT / "cluster" / "examples"


@pytest.fixture(scope="module")
def ray_head():
    """Dashboard address of a fresh `ray start --head` with its own ports and temp dir."""
    with start_ray_head(num_cpus=2) as head:
        yield head.dashboard


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")  # inside Ray's job SDK
def test_job_runs_in_shipped_working_dir_and_logs_stream(ray_head, tmp_path):
    wd = tmp_path / "job"
    (wd / "skipme").mkdir(parents=True)
    (wd / "skipme" / "blob.bin").write_bytes(b"x" * 1024)
    (wd / "word.txt").write_text("rayppo")
    (wd / "greet.py").write_text(
        "import os\nprint('hello', open('word.txt').read(), 'excluded' if not os.path.exists('skipme') else 'SHIPPED')\n"
    )
    job_id = submit(ray_head, "python greet.py", working_dir=wd, excludes=["/skipme"])
    out = io.StringIO()
    status = follow(connect(ray_head), job_id, out)
    assert str(status) == "SUCCEEDED", out.getvalue()
    assert "hello rayppo excluded" in out.getvalue()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")
def test_cli_ships_the_repo_quotes_overrides_and_exits_1_when_the_job_fails(ray_head, capsys):
    """The driver starts on the cluster from the uploaded repo and fails its own preflight there."""
    config = str(REPO_ROOT / "configs" / "sentiment_tiny.yaml")
    odd = "/no such/dir's"  # space and quote survive the shell
    code = main(
        [
            "--address",
            ray_head,
            config,
            "--set",
            "model.demo_assets=null",
            "--set",
            f"model.policy_path={odd}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == EXIT_JOB_FAILED, out + err
    job_id = re.search(r"submitted job (\S+) to ", out).group(1)
    assert re.fullmatch(r"sentiment_tiny-\d{8}-\d{6}-[0-9a-f]{6}", job_id)  # the run id
    assert f"model.policy_path: folder not found: {odd}" in out
    assert "FAILED" in out
    assert "run.output_dir='runs' is relative" in err
    # the Jobs view (and `ray job list`) shows the run's metadata; the job ran with that folder
    info = connect(ray_head).get_job_info(job_id)
    run_dir = f"runs/{job_id.rsplit('-', 1)[0]}"
    assert info.metadata == {
        "rayppo_run_id": job_id,
        "rayppo_run_name": "sentiment_tiny",
        "rayppo_config": "configs/sentiment_tiny.yaml",
        "rayppo_run_dir": run_dir,
    }
    assert shlex.split(info.entrypoint)[-2:] == ["--run-dir", run_dir]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")
def test_ray_job_stop_leaves_a_resumable_checkpoint(ray_head, demo_assets, tmp_path):
    """`ray job stop` sends SIGTERM: the job's driver ends its step, checkpoints and exits 143."""
    import time

    from demo_run import CONFIG, demo_overrides

    from cluster.pipeline.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    client = connect(ray_head)
    job_id = submit_training(
        ray_head, str(CONFIG), demo_overrides(demo_assets, 1000), run_dir=str(run_dir), client=client
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 900  # the upload, start-up and one step on a loaded machine
    while not (metrics.is_file() and metrics.read_text()):
        status = client.get_job_status(job_id)
        assert not status.is_terminal(), f"{status}: {client.get_job_logs(job_id)[-3000:]}"
        assert time.monotonic() < deadline, "no step finished in time"
        time.sleep(1)
    assert client.stop_job(job_id)
    deadline = time.monotonic() + 600
    while not client.get_job_status(job_id).is_terminal():
        assert time.monotonic() < deadline, "the stopped job did not end in time"
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert str(client.get_job_status(job_id)) == "STOPPED", logs[-3000:]
    ckpt = latest_checkpoint(run_dir)  # complete and valid
    assert "stopped by SIGTERM" in logs and f"{ckpt}  (continue with --resume {run_dir})" in logs, logs[
        -3000:
    ]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three nodes and the demo's start-up on a shared 2-core machine
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")
def test_demo_job_on_three_nodes_started_with_ray_start(demo_assets, tmp_path, capsys):
    """Issue 21: the demo submitted with `python -m cluster.submit` (separate placement) to a
    cluster started as a user starts one: `ray start --head`, then two `ray start --address` on the
    same machine, which share the head's session folder. When the driver connects, every raylet
    sets up the job's runtime env, and Ray's working_dir plugin deleted and unpacked again the
    folder the driver runs in: the job died at start-up (its working directory gone). The learner
    and the rollout worker are pinned to the joined nodes, so actors of both run from the job's
    working dir there."""
    from demo_run import CONFIG, demo_overrides, prompt_file

    steps = 2
    sets = demo_overrides(
        demo_assets,
        steps,
        **{
            "data.prompts_per_step": 8,
            "data.prompts_path": prompt_file(demo_assets, tmp_path, steps * 8),
            "rollout.chunk_size": 4,
            "learner.micro_batch_size": 8,
            "learner.resources": "{learner_node: 1}",
            "rollout.resources": "{rollout_node: 1}",
        },
    )
    workers = [
        {"num_cpus": 1, "resources": {"learner_node": 1}},
        {"num_cpus": 1, "resources": {"rollout_node": 1}},
    ]
    # token auth off on every node: Ray turns it on for a head where ~/.ray/auth_token exists, and
    # a joining node then cannot register
    no_auth = {"RAY_AUTH_MODE": "disabled"}
    run_dir = tmp_path / "run"
    with start_ray_head(num_cpus=1, env_vars=no_auth, workers=workers) as head:
        argv = ["--address", head.dashboard, str(CONFIG), "--run-dir", str(run_dir)]
        code = main(argv + [arg for item in sets for arg in ("--set", item)])
    out, err = capsys.readouterr()
    assert code == 0, out[-6000:] + err[-2000:]
    assert "SUCCEEDED" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))


def test_a_job_driver_uses_its_working_dir_in_place_only_where_raylets_share_the_session(
    tmp_path, monkeypatch
):
    """The rule behind the test above: in place (`local://`) only for a job driver whose working
    dir Ray unpacked into a session folder that other raylets' runtime-env agents also use."""
    session = tmp_path / "session_x"
    wd = session / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    wd.mkdir(parents=True)
    (session / "runtime_env_agent_port_aaaa").write_text("1")
    monkeypatch.delenv(JOB_CONFIG_VAR, raising=False)
    assert in_place_working_dir(wd) is None  # not a job's driver
    monkeypatch.setenv(JOB_CONFIG_VAR, "{}")
    assert in_place_working_dir(wd) is None  # one raylet: Ray's own working dir is safe
    assert in_place_working_dir(tmp_path) is None  # not a folder Ray unpacked
    (session / "runtime_env_agent_port_bbbb").write_text("2")
    env = in_place_working_dir(wd)
    assert env == {"working_dir": f"local://{wd}"}
    check_every_node_shares(env, ["aaaa", "bbbb"])
    with pytest.raises(SharedSessionError, match="nodes elsewhere"):
        check_every_node_shares(env, ["aaaa", "bbbb", "cccc"])  # a node on another machine


def test_build_entrypoint_quotes_every_argument():
    cmd = build_entrypoint("configs/a b.yaml", ["x.y=1 2", "z=$(touch /tmp/pwned)"], "/runs/r 1", "latest")
    assert shlex.split(cmd) == [
        "python",
        "-m",
        "cluster.train",
        "configs/a b.yaml",
        "--set",
        "x.y=1 2",
        "--set",
        "z=$(touch /tmp/pwned)",
        "--run-dir",
        "/runs/r 1",
        "--resume",
        "latest",
    ]
    assert build_entrypoint("c.yaml") == "python -m cluster.train c.yaml"


@contextlib.contextmanager
def _silent_server():
    """A port that accepts TCP connections (kernel backlog) and never answers."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        yield srv


def test_bad_config_exits_2_before_contacting_the_cluster(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "model": {"policy_path": "p"},
                "data": {"prompts_path": "d"},
                "reward": {"kind": "rule", "rule": "r"},
            }
        )
    )
    with _silent_server() as srv:
        address = f"http://127.0.0.1:{srv.getsockname()[1]}"
        assert main(["--address", address, str(bad), "--set", "learner.zero_stage=4"]) == EXIT_BAD_INPUT
        assert "learner.zero_stage" in capsys.readouterr().err
        assert main(["--address", address, str(bad)]) == EXIT_BAD_INPUT  # outside the uploaded repo
        assert "outside the uploaded working dir" in capsys.readouterr().err
        args = [
            "--address",
            address,
            "--working-dir",
            str(tmp_path),
            str(REPO_ROOT / "configs" / "sentiment_tiny.yaml"),
        ]
        assert main(args) == EXIT_BAD_INPUT
        assert "not a rayppo checkout" in capsys.readouterr().err
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody connected


def test_unreachable_address_is_named_in_a_clear_error(capsys):
    config = str(REPO_ROOT / "configs" / "sentiment_tiny.yaml")
    closed = f"http://127.0.0.1:{free_port()}"
    assert main(["--address", closed, config, "--no-wait"]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert f"cannot reach the Ray job API at {closed}" in err
    with _silent_server() as srv:
        silent = f"127.0.0.1:{srv.getsockname()[1]}"
        assert main(["--address", silent, config, "--connect-timeout", "1"]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert f"cannot reach the Ray job API at http://{silent}: no answer within 1s" in err
    assert main(["--address", "ray://head:10001", config]) == EXIT_BAD_INPUT


def test_default_excludes_keep_virtualenvs_runs_and_assets_out():
    from ray._private.thirdparty.pathspec import PathSpec  # the matcher Ray applies to `excludes`

    spec = PathSpec.from_lines("gitwildmatch", DEFAULT_EXCLUDES)
    for path in [".venv/bin/python", ".venv-trl/lib/x.py", "runs/a/metrics.jsonl", "assets/p/model.bin",
                 ".git/HEAD", "cluster/__pycache__/a.pyc", "rayppo.egg-info/PKG-INFO"]:  # fmt: skip
        assert spec.match_file(path), path
    for path in ["cluster/train.py", "configs/sentiment_tiny.yaml", "tests/assets_check.py", ".gitignore"]:
        assert not spec.match_file(path), path


# ---------------------------------------------------------------- examples (schema checks only)


def test_example_gpu_run_config_validates():
    cfg = load_config(EXAMPLES / "qwen_gsm8k_gpu.yaml")
    assert (
        cfg.rollout.engine == "vllm" and cfg.rollout.num_workers == 4 and cfg.rollout.num_gpus_per_worker == 1
    )
    assert cfg.learner.num_ranks == 4 and cfg.learner.zero_stage == 3 and cfg.learner.dtype == "bfloat16"
    assert cfg.learner.num_gpus_per_rank == 1 and cfg.learner.backend == "nccl"
    assert cfg.reward.kind == "rule" and cfg.reward.rule == "exact_match" and cfg.data.meta_keys == ["answer"]
    assert Path(cfg.run.output_dir).is_absolute()  # a job's working dir is a temporary copy


def test_example_cluster_launcher_matches_ray_schema():
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    launcher = yaml.safe_load((EXAMPLES / "aws_gpu_cluster.yaml").read_text())
    jsonschema.validate(launcher, schema)
    assert any("[vllm" in cmd for cmd in launcher["setup_commands"])


def test_example_rayjob_runs_the_example_config():
    job = yaml.safe_load((EXAMPLES / "kuberay_rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "cluster.train"]
    config = Path(argv[3].replace("/home/ray/rayppo/", str(REPO_ROOT) + "/"))
    load_config(config, argv[5::2])
