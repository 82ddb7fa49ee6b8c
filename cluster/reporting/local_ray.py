"""The dashboard port of a local Ray (`cluster.address` unset): two runs on one machine.

Ray's dashboard takes one port; a second local Ray asked for the same one ends in Ray's own traceback
(`ValueError: Failed to bind to 127.0.0.1:8265`). Here, a port the config does not set is left to
Ray, which takes 8265 or, when another run holds it, the next free one: the run says which. A port
the config sets is the user's choice: taken, the run stops before Ray starts with one line naming
`cluster.dashboard_port`.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from cluster.config.schema import ConfigError
from cluster.config.sections import ClusterSection

DEFAULT_DASHBOARD_PORT = 8265  # Ray's first choice when no port is given (the next free ones after it)


def port_taken(host: str, port: int) -> bool:
    """Whether `port` on `host` cannot be bound now, tested as Ray tests it before it starts its
    dashboard (a socket with SO_REUSEADDR: a listener in TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def dashboard_port(cluster: ClusterSection) -> int | None:
    """The port a local Ray's dashboard is asked for: None (no port set, or no dashboard: Ray takes
    8265 or the next free one), else the configured port, which must be free: a taken one is a
    ConfigError naming `cluster.dashboard_port` and what to set."""
    port = cluster.dashboard_port
    if port is None or not cluster.dashboard:
        return None
    if port_taken(cluster.dashboard_host, port):
        raise ConfigError(
            f"cluster.dashboard_port: {cluster.dashboard_host}:{port} is taken (another run's Ray dashboard?): "
            "set cluster.dashboard_port to a free port, leave it unset (the next free port from "
            f"{DEFAULT_DASHBOARD_PORT} is taken and printed), or set cluster.dashboard: false"
        )
    return port


def moved_dashboard(url: str | None, cluster: ClusterSection) -> str | None:
    """The line a local run prints when Ray put its dashboard on another port than 8265 because no port
    was set and 8265 was taken; None otherwise."""
    if url is None or cluster.dashboard_port is not None:
        return None
    port = urlsplit(f"http://{url}").port
    if port in (None, DEFAULT_DASHBOARD_PORT):
        return None
    return (
        f"ray dashboard: port {DEFAULT_DASHBOARD_PORT} is taken (another run's Ray?): this run's dashboard is "
        f"on port {port} (cluster.dashboard_port sets one)"
    )
