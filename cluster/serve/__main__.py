"""`python -m cluster.serve CONFIG`: start (or join) Ray, then serve the Tinker API until stopped.

Prints one line `serving <url>` once the socket listens (a caller may connect from then on; the
tests wait for that line). CONFIG: `cluster.serve.config`. `--ray-address` replaces the config's
`ray_address` (`cluster.serve.ray_address`: `auto` joins the cluster this process runs in, as the
entrypoint of a Ray job does, `python -m cluster.serve.submit`); a `local` Ray inside a Ray job is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

import ray
import uvicorn

from cluster.reporting.job_env import SharedSessionError, in_job, join_cluster
from cluster.serve.config import load_serve_config
from cluster.serve.ray_address import LOCAL, ray_address
from cluster.serve.service import Service, build_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.serve", description=__doc__)
    parser.add_argument("config", help="the service's YAML (cluster/serve/config.py)")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray instead of the config's ray_address ('auto': the cluster this process runs in)",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_serve_config(args.config)
        address = ray_address(cfg.ray_address, args.ray_address, in_job())
    except (OSError, ValueError) as e:
        print(f"cluster.serve: {args.config}: {e}", file=sys.stderr)
        return 2
    if address == LOCAL:
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        try:  # a job's driver on raylets sharing this machine's session folder: its working dir in place
            join_cluster(address, log_to_driver=False)
        except SharedSessionError as e:
            print(f"cluster.serve: {e}", file=sys.stderr)
            return 1
    app = build_app(Service(cfg))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    print(f"serving http://{host}:{port}", flush=True)
    asyncio.run(server.serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
