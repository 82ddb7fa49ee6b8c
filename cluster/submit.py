"""Submit a training run to a remote Ray cluster as a Ray job and follow it.

`python -m cluster.submit --address http://HEAD:8265 CONFIG [--set k=v ...]` checks the config
here first (a bad one exits 2 before anything is contacted), uploads the repo (or `--working-dir`,
minus virtualenvs, runs, assets, git and caches) as the job's working dir, starts
`python -m cluster.train CONFIG ...` on the cluster and streams its log until it ends: exit 0 if
it succeeded, 1 if it failed or was stopped, 3 if the cluster cannot be reached. Ctrl-C stops
following, not the job.

The job API runs arbitrary code: reach it over an SSH tunnel (`ssh -L 8265:127.0.0.1:8265 head`),
never an open port. Clusters with Ray token auth get the local token (RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), sent only when the cluster asks for one.

The job's submission id is the run id (`<run folder name>-<6 hex>`): it names the run's actors and
tags its metrics. The job carries metadata for the Jobs view and `ray job list`: `rayppo_run_id`,
`rayppo_run_name`, `rayppo_config` and `rayppo_run_dir` (the folder is chosen here and passed as
`--run-dir`, so the metadata names the folder the run writes).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import secrets
import shlex
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from cluster.config.schema import ConfigError, RunConfig, load_config
from cluster.train import add_run_arguments, run_dir_for

if TYPE_CHECKING:
    from ray.job_submission import JobStatus, JobSubmissionClient

EXIT_OK, EXIT_JOB_FAILED, EXIT_BAD_INPUT, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# gitwildmatch patterns relative to the working dir ("/x" = only at its top). Ray >= 2.5x also skips
# .git/.venv/__pycache__ and what .gitignore lists; these keep older Rays and odd layouts small
# (Ray refuses a working dir over ~512 MiB, its gRPC message limit).
DEFAULT_EXCLUDES = [
    "/.venv*",
    "/venv",
    "/runs",
    "/assets",
    "/build",
    "/dist",
    ".git",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".hypothesis",
    "*.egg-info",
    ".stamp-*",
]


_ID_BAD = re.compile(r"[^A-Za-z0-9_.-]")  # a run id goes into actor names, URLs and metric labels


class ClusterUnreachable(RuntimeError):
    """The job API did not answer, refused the token, or dropped the log stream."""


def build_entrypoint(
    config: str, overrides: list[str] | None = None, run_dir: str | None = None, resume: str | None = None
) -> str:
    """The shell command the job runs on the cluster; every argument is quoted."""
    args = ["python", "-m", "cluster.train", config]
    for item in overrides or []:
        args += ["--set", item]
    if run_dir:
        args += ["--run-dir", run_dir]
    if resume:
        args += ["--resume", resume]
    return shlex.join(args)


def normalize_address(address: str) -> str:
    if "://" not in address:
        address = "http://" + address
    if not address.startswith(("http://", "https://")):
        raise ConfigError(
            f"--address {address!r}: expected the job API's http(s)://HOST:PORT (dashboard port, 8265 by "
            "default), not a ray:// or GCS address"
        )
    return address.rstrip("/")


def _local_token() -> str | None:
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _probe(address: str, headers: dict[str, str], timeout_s: float) -> int:
    """HTTP status of GET /api/version; raises ClusterUnreachable when nothing answers in time."""
    req = urllib.request.Request(address + "/api/version", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError) or isinstance(err, TimeoutError):
            reason = f"no answer within {timeout_s:g}s"
        raise ClusterUnreachable(
            f"cannot reach the Ray job API at {address}: {reason}. Is the head running with its dashboard "
            "(ray start --head --include-dashboard=true), and is the port forwarded "
            "(ssh -L 8265:127.0.0.1:8265 HEAD)?"
        ) from None


def check_api(address: str, timeout_s: float = 10.0) -> dict[str, str]:
    """Bounded reachability and auth check of the job API; returns the headers to send."""
    address = normalize_address(address)
    headers: dict[str, str] = {}
    status = _probe(address, headers, timeout_s)
    if status == 401:
        token = _local_token()
        if token is None:
            raise ClusterUnreachable(
                f"the Ray cluster at {address} requires an auth token and none was found: set RAY_AUTH_TOKEN "
                "or RAY_AUTH_TOKEN_PATH (`ray get-auth-token` on the head prints it)"
            )
        headers = {"Authorization": f"Bearer {token}"}
        status = _probe(address, headers, timeout_s)
    if status in (401, 403):
        raise ClusterUnreachable(f"the Ray cluster at {address} rejected the auth token (HTTP {status})")
    if status != 200:
        raise ClusterUnreachable(f"{address}/api/version answered HTTP {status}: is this a Ray dashboard?")
    return headers


def connect(
    address: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None
) -> JobSubmissionClient:
    """A job client for `address`, after `check_api` (skipped when its headers are passed in)."""
    address = normalize_address(address)
    if headers is None:
        headers = check_api(address, timeout_s)

    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address, headers=headers)
    except (ConnectionError, RuntimeError, AuthenticationError) as err:
        raise ClusterUnreachable(f"Ray job API at {address}: {err}") from None


def submit(
    address: str,
    entrypoint: str,
    *,
    working_dir: str | Path | None = REPO_ROOT,
    excludes: list[str] | None = None,
    env_vars: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    submission_id: str | None = None,
    timeout_s: float = 10.0,
    client: JobSubmissionClient | None = None,
) -> str:
    """Start `entrypoint` as a Ray job and return its id (`submission_id`, or one Ray makes up);
    `working_dir=None` uploads nothing."""
    client = client or connect(address, timeout_s)
    runtime_env: dict[str, Any] = {}
    if working_dir is not None:
        wd = Path(working_dir)
        if not wd.is_dir():
            raise ConfigError(f"--working-dir: not a folder: {wd}")
        runtime_env["working_dir"] = str(wd.resolve())
        runtime_env["excludes"] = list(DEFAULT_EXCLUDES if excludes is None else excludes)
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    return client.submit_job(
        entrypoint=entrypoint, runtime_env=runtime_env or None, metadata=metadata, submission_id=submission_id
    )


def config_path_on_cluster(config: str, working_dir: str | Path | None) -> str:
    """The config's path as the job sees it: relative to the uploaded working dir."""
    if working_dir is None:
        return config
    path, root = Path(config).resolve(), Path(working_dir).resolve()
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        raise ConfigError(
            f"config {config} is outside the uploaded working dir {root}: move it there or pass --working-dir"
        ) from None


CHECKPOINT_MARGIN_S = 300  # after the grace period: the stop's checkpoint, summary and shutdown


def job_stop_wait_s(cfg: RunConfig) -> int:
    """How long `ray job stop` waits after its SIGTERM before SIGKILL (`RAY_JOB_STOP_WAIT_TIME_S`,
    read by the job's supervisor; Ray's default 3 s would kill the run before its checkpoint)."""
    return int(math.ceil(cfg.checkpoint.stop_grace_s + CHECKPOINT_MARGIN_S))


def submit_training(
    address: str,
    config: str,
    overrides: list[str] | None = None,
    *,
    run_dir: str | None = None,
    resume: str | None = None,
    working_dir: str | Path | None = REPO_ROOT,
    timeout_s: float = 10.0,
    client: JobSubmissionClient | None = None,
) -> str:
    """Validate the config here (ConfigError before any contact), then submit `cluster.train`
    under a run id of its own, with the run's metadata."""
    cfg = load_config(config, overrides)
    config_on_cluster = config_path_on_cluster(config, working_dir)
    if resume:  # the resumed run's folder (found on the cluster for 'auto')
        folder = None if resume == "auto" else resume
    else:
        run_dir = folder = str(run_dir_for(cfg, run_dir, resolve=False))  # the cluster resolves it
    stem = Path(folder).name if folder else f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_id = f"{_ID_BAD.sub('_', stem)}-{secrets.token_hex(3)}"
    metadata = {
        "rayppo_run_id": run_id,
        "rayppo_run_name": cfg.run.name,
        "rayppo_config": config_on_cluster,
        "rayppo_run_dir": folder or f"newest {cfg.run.output_dir}/{cfg.run.name}-* (--resume auto)",
    }
    entrypoint = build_entrypoint(config_on_cluster, overrides, run_dir, resume)
    return submit(
        address,
        entrypoint,
        working_dir=working_dir,
        env_vars={"RAY_JOB_STOP_WAIT_TIME_S": str(job_stop_wait_s(cfg))},
        metadata=metadata,
        submission_id=run_id,
        timeout_s=timeout_s,
        client=client,
    )


def follow(
    client: JobSubmissionClient, job_id: str, out: TextIO | None = None, settle_s: float = 60.0
) -> JobStatus:
    """Stream the job's log to `out` until it ends; returns its final status."""
    out = out or sys.stdout

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(tail())
    except RuntimeError as err:  # websocket closed abnormally: the job itself may be fine
        raise ClusterUnreachable(f"log stream of job {job_id} lost: {err}") from None
    deadline = time.monotonic() + settle_s  # the stream ends as the job ends; its status follows shortly
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    return status


def _run_dir_warning(cfg: RunConfig, run_dir: str | None, working_dir: str | Path | None) -> str | None:
    if working_dir is None or run_dir or Path(cfg.run.output_dir).is_absolute():
        return None
    return (
        f"warning: run.output_dir={cfg.run.output_dir!r} is relative, so the run folder lands inside the "
        "job's temporary copy of the working dir on the cluster; pass --run-dir /shared/path or "
        "--set run.output_dir=/shared/path to keep it"
    )


def add_cluster_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every submission takes: the job API, the uploaded working dir, following or not."""
    ap.add_argument(
        "--address",
        default=os.environ.get("RAY_API_SERVER_ADDRESS", DEFAULT_ADDRESS),
        help=f"Ray job API (dashboard) address (default: $RAY_API_SERVER_ADDRESS or {DEFAULT_ADDRESS})",
    )
    wd = ap.add_mutually_exclusive_group()
    wd.add_argument(
        "--working-dir", default=str(REPO_ROOT), help="folder uploaded as the job's cwd (default: this repo)"
    )
    wd.add_argument(
        "--no-working-dir",
        action="store_true",
        help="upload nothing: the cluster has rayppo installed and CONFIG is a path there",
    )
    ap.add_argument("--no-wait", action="store_true", help="print the job id and return")
    ap.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to wait for the job API (default 10)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m cluster.submit", description="Submit a PPO training run to a Ray cluster as a job."
    )
    add_run_arguments(ap)  # CONFIG, --set, --run-dir (on the cluster: shared storage), --resume
    add_cluster_arguments(ap)
    return ap.parse_args(argv)


def checked_working_dir(args: argparse.Namespace) -> str | None:
    """The folder to upload (None: `--no-working-dir`); ConfigError unless it is a rayppo checkout."""
    working_dir = None if args.no_working_dir else args.working_dir
    if working_dir is not None and not Path(working_dir, "pyproject.toml").is_file():
        # an installed (non-editable) rayppo would otherwise upload site-packages
        raise ConfigError(
            f"--working-dir {working_dir} is not a rayppo checkout (no pyproject.toml): pass the checkout, "
            "or --no-working-dir when the cluster has rayppo installed"
        )
    return working_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        working_dir = checked_working_dir(args)
        address = normalize_address(args.address)
        cfg = load_config(args.config, args.overrides)
        config_path_on_cluster(args.config, working_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if warning := _run_dir_warning(cfg, args.run_dir, working_dir):
        print(warning, file=sys.stderr)

    def start(client: JobSubmissionClient) -> str:
        return submit_training(
            address,
            args.config,
            args.overrides,
            run_dir=args.run_dir,
            resume=args.resume,
            working_dir=working_dir,
            client=client,
        )

    return submit_and_follow(address, start, connect_timeout_s=args.connect_timeout, wait=not args.no_wait)


def submit_and_follow(
    address: str,
    start: Callable[[JobSubmissionClient], str],
    *,
    connect_timeout_s: float = 10.0,
    wait: bool = True,
) -> int:
    """Check the job API, submit with `start(client)` (returns the job id), print where to watch and
    stop the job, then (`wait`) stream its log until it ends; returns the command's exit code."""
    try:
        headers = check_api(address, connect_timeout_s)
        client = connect(address, headers=headers)
        job_id = start(client)
    except ValueError as err:  # ConfigError, or Ray refusing the working dir (e.g. over its size limit)
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ClusterUnreachable as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except RuntimeError as err:  # the job API answered but refused the job
        print(f"error: {address} refused the job: {err}", file=sys.stderr)
        return EXIT_UNREACHABLE
    # the `ray job` CLI sends the local token only when told that the cluster uses token auth
    prefix = "RAY_AUTH_MODE=token " if headers else ""

    def ray_job(cmd: str) -> str:
        return f"{prefix}ray job {cmd} --address {address} {job_id}"

    print(f"submitted job {job_id} to {address}", flush=True)
    print(f"  dashboard: {address}/#/jobs/{job_id}", flush=True)
    print(f"  logs:      {ray_job('logs --follow')}", flush=True)
    print(f"  stop:      {ray_job('stop')}", flush=True)
    if not wait:
        return EXIT_OK
    try:
        status = follow(client, job_id)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; job {job_id} keeps running. Stop it with: {ray_job('stop')}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except ClusterUnreachable as err:
        print(f"error: {err}; the job may still be running: {ray_job('status')}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(f"job {job_id}: {status}", flush=True)
    if str(status) == "SUCCEEDED":
        return EXIT_OK
    info = client.get_job_info(job_id)
    if info.message:
        print(f"  {info.message}", file=sys.stderr)
    return EXIT_JOB_FAILED


if __name__ == "__main__":
    sys.exit(main())
