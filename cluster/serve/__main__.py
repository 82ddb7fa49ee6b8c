"""`python -m cluster.serve CONFIG`: start (or join) Ray, then serve the Tinker API until stopped.

Prints one line `serving <url>` once the socket listens (a caller may connect from then on; the
tests wait for that line). CONFIG: `cluster.serve.config`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

import ray
import uvicorn

from cluster.serve.config import load_serve_config
from cluster.serve.service import Service, build_app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.serve", description=__doc__)
    parser.add_argument("config", help="the service's YAML (cluster/serve/config.py)")
    args = parser.parse_args(argv)
    try:
        cfg = load_serve_config(args.config)
    except (OSError, ValueError) as e:
        print(f"cluster.serve: {args.config}: {e}", file=sys.stderr)
        return 2
    if cfg.ray_address == "local":
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=cfg.ray_address, log_to_driver=False)
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
