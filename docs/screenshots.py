"""Pictures of what a person sees while a demo run trains: the Ray dashboard's Actors view and
Prometheus' graph of the run's metrics, taken with headless Chromium.

    apt-get install chromium prometheus
    PYTHONPATH=. .venv/bin/python docs/screenshots.py [--out docs] [--steps 12]

It starts a local Ray of its own (a temporary --temp-dir, free ports, dashboard on 127.0.0.1 with
token auth off: nothing but this machine can reach it), Prometheus over that Ray's
service-discovery file (`cluster.watch`), and the demo in async mode; it photographs the pages
while the run trains, then stops everything it started. Debian packages no Grafana, so the run's
Grafana dashboard (cluster/dashboards/rayppo.json) is pictured through Prometheus' graph page
of the same expressions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a loopback-only, throw-away cluster
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")  # Ray's export period (default 10 s)

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "sentiment_tiny.yaml"
GRAPHS = [  # Prometheus graph page: the dashboard's reward, KL and worker-lag metrics
    "ray_rayppo_reward_mean",
    "ray_rayppo_kl",
    "ray_rayppo_worker_version_lag",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shoot(url: str, path: Path, size: str = "1600,1000", wait_ms: int = 12000) -> None:
    """One PNG of `url` from headless Chromium (waits `wait_ms` of page time for the data to load)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        raise SystemExit("no chromium on PATH: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="rayppo-chromium-") as profile:
        cmd = [
            exe,
            "--headless=new",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={path}",
            url,
        ]
        subprocess.run(cmd, check=True, timeout=180, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"wrote {path}", flush=True)


def prometheus_graph_url(base: str, run: str, minutes: int = 10) -> str:
    params = {}
    for i, metric in enumerate(GRAPHS):
        params.update(
            {
                # Ray exports a gauge once after each set, so between steps the series has no sample
                # (Grafana's panels span those gaps); last_over_time draws the same values as lines
                f"g{i}.expr": f'last_over_time({metric}{{run="{run}"}}[1m])',
                f"g{i}.tab": "0",
                f"g{i}.range_input": f"{minutes}m",
                f"g{i}.stacked": "0",
                f"g{i}.show_exemplars": "0",
            }
        )
    return f"{base}/graph?{urllib.parse.urlencode(params)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs"), help="folder of the PNGs (default docs/)")
    ap.add_argument("--steps", type=int, default=12, help="demo steps (default 12)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import ray

    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run
    from cluster.watch import watching

    temp_dir = tempfile.mkdtemp(prefix="rps", dir="/tmp")  # short: Ray's unix sockets live under it
    work = Path(tempfile.mkdtemp(prefix="rayppo-shots-"))
    prom_port, dash_port = free_port(), free_port()
    os.environ["RAY_PROMETHEUS_HOST"] = f"http://127.0.0.1:{prom_port}"  # the dashboard asks it
    overrides = [
        f"run.steps={args.steps}",
        "run.progress_bar=false",
        "run.loggers=[jsonl,prometheus]",
        "run.sample_log_count=0",
        "pipeline.mode=async",
        f"run.output_dir={work}",
    ]
    cfg = load_config(CONFIG, overrides)
    ray.init(
        num_cpus=4,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dash_port,
        _temp_dir=temp_dir,
        log_to_driver=False,
    )
    dashboard = f"http://127.0.0.1:{dash_port}"
    run_dir = work / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer: Run | None = None  # None until set-up completes (a failed set-up stops what it started)
    failure: list[BaseException] = []

    def train() -> None:
        try:
            trainer.train()
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            failure.append(err)

    try:
        with watching(temp_dir, work / "prometheus", prom_port, scrape_interval_s=2.0) as prom:
            trainer = Run(cfg, run_dir)
            worker = threading.Thread(target=train, daemon=True)
            worker.start()
            deadline = time.monotonic() + 1800
            while (
                trainer.step < max(2, args.steps // 2) and worker.is_alive() and time.monotonic() < deadline
            ):
                time.sleep(1.0)
            if failure:
                raise failure[0]
            shoot(f"{dashboard}/#/actors", out / "ray-dashboard-actors.png")
            worker.join(timeout=1800)
            if failure:
                raise failure[0]
            time.sleep(6.0)  # the last step's values: Ray exports each 2 s, Prometheus scrapes each 2 s
            shoot(
                prometheus_graph_url(prom.url, trainer.run_id),
                out / "prometheus-run-metrics.png",
                "1600,2190",
            )
    finally:
        if trainer is not None:
            trainer.close()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
