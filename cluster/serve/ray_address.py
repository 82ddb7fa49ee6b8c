"""Which Ray the service joins: its config's `ray_address`, or the `--ray-address` of its command line
(`python -m cluster.serve.submit` passes `auto`: the cluster of the Ray job the service runs as).

    local       start a Ray of this process's own (refused inside a Ray job: a second cluster beside
                the job's, which the job's dashboard, `ray job stop` and its resources know nothing of)
    auto        Ray's own "join the cluster this process runs in": RAY_ADDRESS (a job's entrypoint has
                it), else the `ray start` of this machine
    HOST:PORT   join that cluster (also `ray://HOST:PORT`)
"""

from __future__ import annotations

LOCAL, AUTO = "local", "auto"


def ray_address(configured: str, override: str | None, in_job: bool) -> str:
    """The address the service passes to ray.init: `override` where given, else `configured`. An
    override never replaces a cluster the config names (only `local` or `auto`), and `local` is refused
    inside a Ray job (`in_job`); both a ValueError naming `ray_address`."""
    if override is not None and configured not in (LOCAL, AUTO, override):
        raise ValueError(
            f"ray_address: {configured!r} names a cluster to join, and --ray-address asks for {override!r}: "
            f"set ray_address to {LOCAL!r} or {AUTO!r} (a service submitted as a Ray job joins the job's "
            "cluster)"
        )
    address = configured if override is None else override
    if address == LOCAL and in_job:
        raise ValueError(
            f"ray_address: {LOCAL!r} starts a Ray cluster of its own, and this process runs as a Ray job: "
            f"it would be a second cluster beside the job's. Join the job's with ray_address: {AUTO} or "
            f"--ray-address {AUTO} (python -m cluster.serve.submit passes it)"
        )
    return address
