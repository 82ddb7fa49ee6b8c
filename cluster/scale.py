"""Scale a running job's roles: `python -m cluster.scale --address ADDR --job ID rollout=3`.

Writes the wanted counts into the run's named control actor; the trainer applies them
between iterations (new workers load the current weights before their first sample; removed
workers hold no prompts at that point). With an http:// dashboard address the request is sent
as a tiny Ray job, so only the job API needs to be reachable.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from cluster.pipeline.control import NAMESPACE, ROLES, control_name


def parse_assignments(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        role, _, count = item.partition("=")
        if role not in ROLES or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{item!r}: expected ROLE=COUNT with ROLE in {', '.join(ROLES)} and COUNT >= 1")
        out[role] = int(count)
    if not out:
        raise ValueError(f"nothing to scale; e.g. rollout=3 (roles: {', '.join(ROLES)})")
    return out


def apply(run_id: str, counts: dict[str, int], timeout: float = 30.0) -> dict[str, int]:
    """Set the targets on the run's control actor (Ray must be initialised)."""
    import ray

    try:
        control = ray.get_actor(control_name(run_id), namespace=NAMESPACE)
    except ValueError:
        raise ValueError(
            f"no running job with id {run_id!r} (control actor {control_name(run_id)} not found)"
        ) from None
    targets = {}
    for role, count in counts.items():
        targets = ray.get(control.set_target.remote(role, count), timeout=timeout)
    return targets


def _via_job_api(address: str, run_id: str, counts: dict[str, int]) -> int:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    args = " ".join(shlex.quote(f"{k}={v}") for k, v in counts.items())
    job = client.submit_job(entrypoint=f"python -m cluster.scale --job {shlex.quote(run_id)} {args}")
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = client.get_job_status(job)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            print(client.get_job_logs(job), end="")
            return 0 if status == JobStatus.SUCCEEDED else 1
        time.sleep(1.0)
    print(f"error: scale request {job} did not finish within 120s", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.scale", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--address",
        default=None,
        help="http://HOST:8265 (job API), ray://HOST:10001 or HOST:6379; default: current",
    )
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--job", help="Ray job submission id of the training run")
    who.add_argument("--run", help="run id printed by the driver (the run folder name) when not run as a job")
    ap.add_argument("counts", nargs="+", metavar="ROLE=COUNT", help=f"roles: {', '.join(ROLES)}")
    args = ap.parse_args(argv)
    try:
        counts = parse_assignments(args.counts)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    run_id = args.job or args.run
    if args.address and args.address.startswith(("http://", "https://")):
        return _via_job_api(args.address, run_id, counts)
    import ray

    if not ray.is_initialized():
        ray.init(address=args.address or "auto", namespace=NAMESPACE, log_to_driver=False)
    try:
        targets = apply(run_id, counts)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"targets for {run_id}: " + ", ".join(f"{k}={v}" for k, v in targets.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
