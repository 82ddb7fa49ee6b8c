"""A job driver's working dir on a cluster whose raylets share this machine's session folder.

`cluster.submit` (like `ray job submit --working-dir`) ships the repo as the job's `working_dir`.
Each node's runtime-env agent unpacks it into `<session>/runtime_resources/working_dir_files/
_ray_pkg_<hash>`, and replaces that folder (deletes it, then unpacks again) the first time it sets
the URI up itself (Ray's `WorkingDirPlugin.create` calls `download_and_unpack_package` with
`overwrite=True`, ray-project/ray#49313). When the driver connects, every raylet installs the job's
runtime env (`eager_install`). Raylets on separate machines unpack into their own disks; raylets
started on one machine (`ray start --head` plus `ray start --address` there, or
`ray.cluster_utils.Cluster`) share one session folder, so each of them deletes and rebuilds the
folder the job's driver already runs in: its working directory is gone (`os.getcwd()` raises
FileNotFoundError) and imports from it fail while it is rebuilt.

On such a cluster the driver hands the job that folder in place instead (`local://`): every raylet
of the machine sees it, Ray neither downloads nor deletes it, and every worker gets the same
working directory and PYTHONPATH as before. Anywhere else nothing changes. `join_cluster` is that
ray.init, for every job driver that joins its cluster (`cluster.train`, `cluster.serve`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for the entrypoint
OVERRIDE_VAR = "RAY_OVERRIDE_JOB_RUNTIME_ENV"  # lets ray.init's runtime_env replace the job's fields
AGENT_PORT_FILE = "runtime_env_agent_port_"  # <session>/runtime_env_agent_port_<node id>: one per raylet
UNPACKED_UNDER = ("runtime_resources", "working_dir_files")  # <session>/<these>/_ray_pkg_<hash>
LOCAL = "local://"


class SharedSessionError(RuntimeError):
    """Raylets share this machine's session folder and other nodes of the cluster do not."""


def session_of(working_dir: Path) -> Path | None:
    """The Ray session folder holding `working_dir` when Ray unpacked it there, else None."""
    if (working_dir.parent.parent.name, working_dir.parent.name) != UNPACKED_UNDER:
        return None
    return working_dir.parents[2]


def agent_nodes(session: Path) -> set[str]:
    """Ids of the nodes whose runtime-env agents unpack into `session` (the raylets of this machine)."""
    return {p.name[len(AGENT_PORT_FILE) :] for p in session.glob(AGENT_PORT_FILE + "*")}


def in_job() -> bool:
    """Whether this process is a Ray job's entrypoint (or runs under one): its cluster is the job's."""
    return JOB_CONFIG_VAR in os.environ


def in_place_working_dir(cwd: Path | None = None) -> dict[str, Any] | None:
    """The runtime env a job driver passes to ray.init where other raylets share the session folder
    of the working dir it runs in; None (Ray's own is safe) elsewhere and outside a job."""
    if not in_job():
        return None
    cwd = cwd or Path.cwd()
    session = session_of(cwd)
    if session is None or len(agent_nodes(session)) < 2:
        return None
    return {"working_dir": LOCAL + str(cwd)}


@contextlib.contextmanager
def override_job_runtime_env() -> Iterator[None]:
    """Around ray.init: its runtime_env replaces the job's fields (Ray refuses a conflict otherwise)."""
    before = os.environ.get(OVERRIDE_VAR)
    os.environ[OVERRIDE_VAR] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OVERRIDE_VAR, None)
        else:
            os.environ[OVERRIDE_VAR] = before


def check_every_node_shares(runtime_env: dict[str, Any], alive_nodes: Iterable[str]) -> None:
    """After ray.init with `in_place_working_dir`: nodes on other machines would not find the folder."""
    working_dir = Path(runtime_env["working_dir"][len(LOCAL) :])
    session = session_of(working_dir)
    elsewhere = sorted(set(alive_nodes) - agent_nodes(session)) if session else []
    if elsewhere:
        raise SharedSessionError(
            f"this machine runs several raylets that share the session folder {session}, and the "
            f"cluster has nodes elsewhere ({', '.join(n[:8] for n in elsewhere)}): a job's working dir "
            "cannot serve both. Start each extra raylet on this machine with a --temp-dir of its own"
        )


def join_cluster(address: str, **init_kwargs: Any) -> Any:
    """`ray.init(address, **init_kwargs)` joining a running cluster; a job's driver on raylets that
    share this machine's session folder hands them its working dir in place (`in_place_working_dir`,
    said in one printed line) and checks that every node does share it. Returns ray.init's context."""
    import ray

    in_place = in_place_working_dir()
    if in_place is None:
        return ray.init(address=address, **init_kwargs)
    with override_job_runtime_env():
        context = ray.init(address=address, runtime_env=in_place, **init_kwargs)
    print(f"job working dir used in place by this machine's raylets: {in_place['working_dir']}", flush=True)
    check_every_node_shares(in_place, [n["NodeID"] for n in ray.nodes() if n["Alive"]])
    return context
