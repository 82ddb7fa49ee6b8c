"""The Grafana dashboard against what a run exports, through a real Prometheus (`cluster.watch`).

The live test starts a Ray head of its own (ports, temp dir), Prometheus on a free port over that
head's service-discovery file, and the demo (async mode, a few steps) as a driver process that
stays connected after training until the test has asked Prometheus everything. It is skipped
where the `prometheus` binary is missing (`apt-get install prometheus`).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from demo_run import CONFIG, SMALL_STEPS, demo_overrides
from ray_head import free_port, ray_head

from cluster.reporting import telemetry
from cluster.reporting.metrics import read_metrics
from cluster.watch import DASHBOARD, install_dashboard, prometheus_config, session_dir, watching

REPO = Path(__file__).resolve().parent.parent
METRIC = re.compile(r"\bray_rayppo_[a-z_]+")
# Dashboard metrics a run exports only under conditions the demo below does not meet.
CONDITIONAL = {
    "ray_rayppo_eval_reward_mean": "set only when the run evaluates held-out prompts",
    "ray_rayppo_eval_accuracy": "set only when the run evaluates held-out prompts",
    "ray_rayppo_eval_response_length": "set only when the run evaluates held-out prompts",
}
# Exported series no panel reads: the step-time histogram is read through its buckets (Ray's
# histogram _sum adds bucket midpoints, not the observed values, so no panel shows a mean from it).
UNPANELLED = {"ray_rayppo_step_seconds_sum", "ray_rayppo_step_seconds_count"}
STEPS = 3
# Async: the pipeline with the most metrics; small steps: the metrics are checked, not the learning.
RUN = {**SMALL_STEPS, "pipeline.mode": "async"}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out += [panel, *panel.get("panels", [])]
    return out


def dashboard_metrics() -> set[str]:
    """Every metric name in a panel expression or a template variable query."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return {name for expr in exprs for name in METRIC.findall(expr)}


def test_dashboard_is_well_formed_and_templated_by_run():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["multi"] and variables["run"]["includeAll"]
    graphs = [p for p in panels(dash) if p["type"] != "row"]
    rows = [p["title"] for p in panels(dash) if p["type"] == "row"]
    assert len(rows) >= 8 and len(graphs) >= 20
    for p in graphs:
        assert p["datasource"]["uid"] == "${datasource}" and p["description"], p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        for t in p["targets"]:
            assert '{run=~"$run"}' in t["expr"], (p["title"], t["expr"])


def test_dashboard_reads_every_metric_telemetry_declares_and_nothing_else():
    names = dashboard_metrics()
    declared = {f"ray_{n}" for n, _ in [*telemetry.GAUGES.values(), *telemetry.TOTALS.values()]}
    assert declared <= names, f"exported but on no panel: {sorted(declared - names)}"
    source = Path(telemetry.__file__).read_text()
    defined = set(re.findall(r'"(rayppo_[a-z_]+)"', source))
    series = {n.removeprefix("ray_") for n in names}  # a series, or a counter's/histogram's part of one
    unknown = sorted(
        n for n in series if n not in defined and re.sub(r"_(total|count|bucket)$", "", n) not in defined
    )
    assert not unknown, f"panels query metrics cluster/reporting/telemetry.py does not export: {unknown}"


def test_prometheus_config_scrapes_rays_service_discovery_file(tmp_path):
    config = json.loads(prometheus_config(tmp_path / "sd.json", 2.0))  # JSON is valid YAML
    assert config["global"]["scrape_interval"] == "2s"
    assert config["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(tmp_path / "sd.json")]


DRIVER = """
import pathlib, sys, time
from cluster.train import main
sentinel = pathlib.Path(sys.argv[1])
code = main(sys.argv[2:])
print(f"TRAINED {code}", flush=True)
deadline = time.monotonic() + 600  # stay connected (metrics keep flowing) until the test is done
while not sentinel.exists() and time.monotonic() < deadline:
    time.sleep(0.2)
sys.exit(code)
"""


def _last(prom, metric: str, sel: str) -> list[float]:
    """The latest sample of each series of `metric` in the last 30 minutes. Ray keeps a gauge in its
    export for two export periods after each set, so between steps a plain query may find none."""
    return [float(r["value"][1]) for r in prom.query(f"last_over_time({metric}{sel}[30m])")]


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="no prometheus binary (apt-get install prometheus)"
)
def test_prometheus_sees_every_dashboard_metric_of_a_live_demo_run(demo_assets, tmp_path):
    fast = {
        "RAY_metrics_report_interval_ms": "1000",  # Ray's export period (default 10 s)
        "RAY_AUTH_MODE": "disabled",  # Ray turns token auth on when ~/.ray/auth_token exists; the driver too
    }
    run_dir = tmp_path / f"watch-{uuid.uuid4().hex[:6]}"
    run = run_dir.name  # the run id: the run folder's name
    sentinel = tmp_path / "done"
    t0 = time.time()
    with ray_head(num_cpus=4, env_vars=fast) as head:
        assert install_dashboard(session_dir(head.temp_dir)) is not None  # next to Ray's dashboards
        with watching(head.temp_dir, tmp_path / "prom", free_port(), scrape_interval_s=1.0) as prom:
            argv = [
                str(CONFIG),
                *sum(
                    (["--set", o] for o in demo_overrides(demo_assets, STEPS, **RUN)),
                    [],
                ),
            ]
            env = {**head.env, **fast, "RAY_ADDRESS": head.address, "PYTHONPATH": str(REPO)}
            log_path = tmp_path / "driver.log"
            with log_path.open("w") as log:
                driver = subprocess.Popen(
                    [sys.executable, "-c", DRIVER, str(sentinel), *argv, "--run-dir", str(run_dir)],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:
                deadline = time.monotonic() + 900.0  # a few steps of the demo on a loaded 2-core machine
                while "TRAINED" not in log_path.read_text() and driver.poll() is None:
                    assert time.monotonic() < deadline, log_path.read_text()[-6000:]
                    time.sleep(0.5)
                assert "TRAINED 0" in log_path.read_text(), log_path.read_text()[-6000:]
                _check_prometheus(prom, run, run_dir, t0)
                _check_actor_names(head.dashboard, run)
            finally:
                sentinel.touch()
                try:
                    driver.wait(timeout=120)
                finally:
                    driver.kill()


def _check_prometheus(prom, run: str, run_dir: Path, t0: float) -> None:
    wanted = dashboard_metrics() - set(CONDITIONAL)
    sel = f'{{run="{run}"}}'
    deadline = time.monotonic() + 180.0  # Ray exports each second here, Prometheus scrapes each second
    while True:
        series = prom.api("series", {"match[]": f'{{__name__=~"ray_rayppo_.+", run="{run}"}}', "start": t0})
        have = {s["__name__"] for s in series}  # every metric with a sample since the test began
        if (
            wanted <= have and _last(prom, "ray_rayppo_steps_total", sel) == [STEPS]
        ) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not wanted - have, f"dashboard metrics without data in Prometheus: {sorted(wanted - have)}"
    assert have - dashboard_metrics() <= UNPANELLED, (
        f"exported, on no panel: {sorted(have - dashboard_metrics())}"
    )
    labels = prom.api("label/run/values", {"match[]": "ray_rayppo_steps_total"})
    assert run in labels  # the dashboard's run variable offers this run

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    rewards = [r["rollout/reward_mean"] for r in rows]
    # every step reached Prometheus exactly once: the step count, and the running sum of rewards
    assert _last(prom, "ray_rayppo_steps_total", sel) == [STEPS]
    (total,) = _last(prom, "ray_rayppo_reward_sum", sel)
    assert math.isclose(total, sum(rewards), rel_tol=1e-6, abs_tol=1e-9)
    (last,) = _last(prom, "ray_rayppo_reward_mean", sel)
    assert math.isclose(last, rewards[-1], rel_tol=1e-6, abs_tol=1e-9)
    (samples,) = _last(prom, "ray_rayppo_samples_total", sel)
    assert samples == sum(r["rollout/samples"] for r in rows)
    assert _last(prom, "ray_rayppo_reward_failures", sel) == [0.0]  # 0, not "no data"
    lags = prom.query(f"last_over_time(ray_rayppo_worker_version_lag{sel}[30m])")
    assert {r["metric"]["worker"] for r in lags} == {"rollout-worker-0"}


def _check_actor_names(dashboard: str, run: str) -> None:
    from ray.util.state import list_actors

    actors = list_actors(address=dashboard, limit=1000, raise_on_missing_output=False)
    names = sorted(a.name for a in actors)
    assert actors and all(names), f"nameless actors: {[a.class_name for a in actors if not a.name]}"
    assert all(n.startswith(f"{run}/") or n == f"rayppo-control-{run}" for n in names), names
    for role in ("rollout-worker-0", "reference-0", "reward-scorer-0", "learner-rank-0"):
        assert f"{run}/{role}" in names, names


def test_watch_names_what_is_missing(tmp_path, capsys):
    from cluster.watch import WatchError, find_prometheus, main

    assert main(["--ray-temp-dir", str(tmp_path)]) == 2
    assert f"no Ray session under {tmp_path}" in capsys.readouterr().err
    with pytest.raises(WatchError, match="apt-get install prometheus"):
        find_prometheus("no-such-prometheus-binary")
