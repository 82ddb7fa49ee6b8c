"""Watch a run: a Prometheus that scrapes the local Ray cluster, and the run's Grafana dashboard.

`python -m cluster.watch` (or `make watch`) starts Debian's `prometheus` binary (`apt-get install
prometheus`) on 127.0.0.1 against the metrics endpoints Ray lists in its service-discovery file
(`<ray temp dir>/session_latest/prom_metrics_service_discovery.json`, rewritten by the head as
nodes come and go), keeps its data in `--data-dir` (default: a temporary folder, removed at exit)
and runs until Ctrl-C. It also copies `cluster/dashboards/rayppo.json` into the session's Grafana
dashboards folder, so a Grafana started with Ray's generated config shows the run's dashboard next
to Ray's own:

    grafana-server --config /tmp/ray/session_latest/metrics/grafana/grafana.ini \\
        --homepath /usr/share/grafana web

(or import the JSON in Grafana: Dashboards > New > Import). For the Ray dashboard's Metrics view,
start the head with `RAY_PROMETHEUS_HOST=http://127.0.0.1:9090` and `RAY_GRAFANA_HOST=http://127.0.0.1:3000`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "rayppo.json"
SD_FILE = (
    "prom_metrics_service_discovery.json"  # ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE
)
DEFAULT_RAY_TEMP_DIR = "/tmp/ray"


class WatchError(RuntimeError):
    """Prometheus is missing, the Ray session is not found, or Prometheus did not come up."""


def session_dir(ray_temp_dir: str | Path = DEFAULT_RAY_TEMP_DIR) -> Path:
    """The current Ray session's folder (what `session_latest` points to) under Ray's temp dir."""
    latest = Path(ray_temp_dir) / "session_latest"
    if not latest.exists():
        raise WatchError(
            f"no Ray session under {ray_temp_dir} (no {latest}): start Ray first (a run, or `ray start --head`), "
            "or pass --ray-temp-dir when Ray was started with --temp-dir"
        )
    return latest.resolve()


def prometheus_config(sd_file: Path, scrape_interval_s: float) -> str:
    """prometheus.yml scraping every target of Ray's file-based service discovery."""
    config = {
        "global": {
            "scrape_interval": f"{scrape_interval_s:g}s",
            "evaluation_interval": f"{scrape_interval_s:g}s",
        },
        "scrape_configs": [
            {"job_name": "ray", "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "10s"}]}
        ],
    }
    return json.dumps(config, indent=2)  # YAML is a superset of JSON


def install_dashboard(session: Path) -> Path | None:
    """Copy the run dashboard into the session's Grafana dashboards folder (Ray provisions it)."""
    folder = session / "metrics" / "grafana" / "dashboards"
    if not folder.is_dir():  # the head runs without its dashboard: no Grafana config was written
        return None
    target = folder / DASHBOARD.name
    shutil.copyfile(DASHBOARD, target)
    return target


@dataclass
class Prometheus:
    """A running Prometheus; `query` asks its HTTP API."""

    url: str
    process: subprocess.Popen
    data_dir: Path

    def api(self, path: str, params: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Any:
        query = f"?{urllib.parse.urlencode(params, doseq=True)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=timeout_s) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise WatchError(f"Prometheus {path}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query: a list of {"metric": labels, "value": [time, "value"]}."""
        return self.api("query", {"query": expr})["result"]

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)


def find_prometheus(binary: str | None = None) -> str:
    path = shutil.which(binary or "prometheus")
    if path is None:
        raise WatchError(
            f"no {binary or 'prometheus'} binary on PATH: install it (Debian/Ubuntu: apt-get install prometheus; "
            "or a release from prometheus.io) or pass --prometheus PATH"
        )
    return path


def start_prometheus(
    session: Path,
    data_dir: Path,
    port: int = 9090,
    scrape_interval_s: float = 10.0,
    binary: str | None = None,
    ready_timeout_s: float = 60.0,
) -> Prometheus:
    """Start Prometheus on 127.0.0.1:`port` scraping `session`'s Ray nodes; waits until it is ready."""
    exe = find_prometheus(binary)
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "prometheus.yml"
    config.write_text(prometheus_config(session / SD_FILE, scrape_interval_s))
    log = (data_dir / "prometheus.log").open("ab")
    cmd = [
        exe,
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=15d",
    ]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    prom = Prometheus(f"http://127.0.0.1:{port}", process, data_dir)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = (data_dir / "prometheus.log").read_text(errors="replace")[-2000:]
            raise WatchError(f"prometheus exited with {process.returncode}:\n{tail}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp,
        ):
            if resp.status == 200:
                return prom
        time.sleep(0.25)
    prom.stop()
    raise WatchError(
        f"prometheus not ready on {prom.url} within {ready_timeout_s:g}s (log: {data_dir}/prometheus.log)"
    )


@contextlib.contextmanager
def watching(
    ray_temp_dir: str | Path = DEFAULT_RAY_TEMP_DIR,
    data_dir: str | Path | None = None,
    port: int = 9090,
    scrape_interval_s: float = 10.0,
    binary: str | None = None,
) -> Iterator[Prometheus]:
    """Prometheus over the current session of the Ray under `ray_temp_dir`, stopped on exit (its
    data kept in `data_dir`, or in a temporary folder that is removed)."""
    session = session_dir(ray_temp_dir)
    install_dashboard(session)
    with contextlib.ExitStack() as stack:
        folder = (
            Path(data_dir)
            if data_dir
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rayppo-prom-")))
        )
        prom = start_prometheus(session, folder, port, scrape_interval_s, binary)
        try:
            yield prom
        finally:
            prom.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m cluster.watch", description="Run Prometheus against the local Ray cluster's metrics."
    )
    ap.add_argument(
        "--ray-temp-dir",
        default=os.environ.get("RAY_TMPDIR", DEFAULT_RAY_TEMP_DIR),
        help=f"Ray's --temp-dir (default: $RAY_TMPDIR or {DEFAULT_RAY_TEMP_DIR})",
    )
    ap.add_argument("--port", type=int, default=9090, help="Prometheus port on 127.0.0.1 (default 9090)")
    ap.add_argument(
        "--data-dir",
        default=None,
        help="Prometheus data folder, e.g. RUN_DIR/prometheus (default: temporary)",
    )
    ap.add_argument(
        "--scrape-interval", type=float, default=10.0, help="seconds (default 10, Ray's export period)"
    )
    ap.add_argument("--prometheus", default=None, help="the prometheus binary (default: from PATH)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with watching(
            args.ray_temp_dir, args.data_dir, args.port, args.scrape_interval, args.prometheus
        ) as prom:
            session = session_dir(args.ray_temp_dir)
            print(f"prometheus: {prom.url} (data: {prom.data_dir})", flush=True)
            print(f"  scraping the targets in {session / SD_FILE}", flush=True)
            print(
                f"  run dashboard: {DASHBOARD} (copied to {session}/metrics/grafana/dashboards/)", flush=True
            )
            print(f"  try: {prom.url}/graph?g0.expr=ray_rayppo_reward_mean", flush=True)
            print("Ctrl-C stops it.", flush=True)
            while prom.process.poll() is None:
                time.sleep(1.0)
            print(f"prometheus exited with {prom.process.returncode}", file=sys.stderr)
            return 1
    except WatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
