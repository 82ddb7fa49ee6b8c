"""A picture of the MLflow UI holding a demo run, taken with headless Chromium.

    apt-get install chromium
    PYTHONPATH=.:tests .venv/bin/python docs/mlflow_screenshot.py [--out docs] [--steps 30]

It starts an `mlflow server` of its own (SQLite store in a temporary folder, 127.0.0.1, a free port:
`tests/mlflow_server.py`), trains the sentiment demo with `run.loggers=[jsonl,mlflow]` into it,
photographs the run's model-metrics page, and stops the server.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "docs")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs"))
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    from mlflow import MlflowClient
    from mlflow_server import start, stop
    from screenshots import shoot

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rayppo-mlflow-") as tmp:
        server, url = start(Path(tmp))
        try:
            cmd = [
                sys.executable, "-m", "cluster.train", str(REPO / "configs" / "sentiment_tiny.yaml"),
                "--run-dir", str(Path(tmp) / "run"),
                "--set", "run.loggers=[jsonl,mlflow]", "--set", f"run.mlflow.tracking_uri={url}",
                "--set", "run.mlflow.experiment=sentiment-demo", "--set", f"run.steps={args.steps}",
                "--set", "run.progress_bar=false", "--set", "cluster.dashboard=false",
            ]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=REPO)
            client = MlflowClient(tracking_uri=url)
            experiment = client.get_experiment_by_name("sentiment-demo")
            run = client.search_runs([experiment.experiment_id])[0]
            page = f"{url}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics"
            shoot(page, out / "mlflow-run-metrics.png", size="1600,1100", wait_ms=90000)
            if not (out / "mlflow-run-metrics.png").is_file():
                raise SystemExit(f"chromium wrote no picture of {page}")
        finally:
            stop(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
