"""Telemetry reaches Ray's Prometheus endpoint with the right names, tags and values."""

from __future__ import annotations

import math
import re
import sys
import time
import urllib.request
import uuid

import pytest

from cluster.reporting.telemetry import Telemetry

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int, run: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Series of one run: (name, sorted labels other than run and Ray's own) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or "rayppo_" not in m.group(1):
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if labels.pop("run", None) != run:
            continue
        keep = tuple(sorted((k, v) for k, v in labels.items() if k in ("role", "le", "worker")))
        out[(m.group(1), keep)] = float(m.group(3))
    return out


STEP1 = {
    "rollout/reward_mean": 0.25,
    "objective/kl": 0.5,
    "objective/kl_coef": 0.2,
    "policy_version": 1.0,
    "throughput/samples_per_s": 10.0,
    "throughput/tokens_per_s": 240.0,
    "time/generate": 1.5,
    "time/score": 0.25,
    "time/train": 2.0,
    "time/weight_sync": 0.125,
    "time/step": 4.0,
    "rollout/reward_failures": 2.0,
    "train/skipped_steps": 0.0,
    "rollout/samples": 64.0,
    "rollout/queue_depth": 3.0,
    "rollout/staleness_mean": 0.0,
}
STEP2 = {
    **STEP1,
    "rollout/reward_mean": 0.75,
    "objective/kl": float("nan"),  # skipped: the gauge keeps 0.5
    "policy_version": 2.0,
    "time/train": 3.0,
    "time/step": 0.3,
    "rollout/reward_failures": 1.0,
    "train/skipped_steps": 1.0,
    "rollout/staleness_mean": 0.5,
}
STEP2.pop("rollout/queue_depth")  # missing: the gauge keeps 3


@pytest.mark.slow  # waits for Ray's ~10 s export interval
def test_metrics_reach_prometheus_endpoint(ray_local):
    run = f"t{uuid.uuid4().hex[:8]}"
    tel = Telemetry(run)
    assert tel.enabled
    tel.record_step(STEP1)
    tel.record_step(STEP2, worker_lags={"rollout-worker-0": 1, "rollout-worker-1.r1": 0})

    expect = {
        ("ray_rayppo_reward_mean", ()): 0.75,
        ("ray_rayppo_kl", ()): 0.5,
        ("ray_rayppo_kl_coef", ()): 0.2,
        ("ray_rayppo_policy_version", ()): 2.0,
        ("ray_rayppo_samples_per_second", ()): 10.0,
        ("ray_rayppo_tokens_per_second", ()): 240.0,
        ("ray_rayppo_trajectory_queue_depth", ()): 3.0,
        ("ray_rayppo_sample_staleness", ()): 0.5,
        ("ray_rayppo_weight_sync_seconds", ()): 0.125,
        ("ray_rayppo_role_busy_seconds", (("role", "rollout"),)): 1.5,
        ("ray_rayppo_role_busy_seconds", (("role", "reward"),)): 0.25,
        ("ray_rayppo_role_busy_seconds", (("role", "learner"),)): 3.0,
        ("ray_rayppo_reward_failures", ()): 3.0,  # totals since the driver started
        ("ray_rayppo_skipped_steps", ()): 1.0,
        ("ray_rayppo_actor_replacements", ()): 0.0,  # never reported: 0, not missing
        ("ray_rayppo_samples_total", ()): 128.0,
        ("ray_rayppo_steps_total", ()): 2.0,
        ("ray_rayppo_step_seconds_count", ()): 2.0,
        ("ray_rayppo_step_seconds_bucket", (("le", "0.5"),)): 1.0,
        ("ray_rayppo_step_seconds_bucket", (("le", "5.0"),)): 2.0,
        ("ray_rayppo_reward_sum", ()): 1.0,  # 0.25 + 0.75: every step's reward once
        ("ray_rayppo_worker_version_lag", (("worker", "rollout-worker-0"),)): 1.0,
        ("ray_rayppo_worker_version_lag", (("worker", "rollout-worker-1.r1"),)): 0.0,
    }
    port = int(ray_local.nodes()[0]["MetricsExportPort"])
    deadline = time.monotonic() + 25.0  # Ray exports about every 10 s
    got: dict = {}
    while time.monotonic() < deadline:
        got = scrape(port, run)
        if all(k in got for k in expect):
            break
        time.sleep(0.5)
    missing = [k for k in expect if k not in got]
    assert not missing, f"not exported within 25 s: {missing}; got {sorted(got)}"
    wrong = {k: (got[k], v) for k, v in expect.items() if not math.isclose(got[k], v, rel_tol=1e-6)}
    assert not wrong, f"(exported, expected): {wrong}"


def test_without_ray_metrics_it_turns_off_and_never_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.util.metrics", None)  # import fails as if Ray were absent
    tel = Telemetry("off")
    assert not tel.enabled
    tel.record_step(STEP1)


@pytest.mark.parametrize("bad", [{"policy_version": "not a number"}, {"time/step": None}, {}])
def test_bad_or_missing_values_are_skipped(bad):
    tel = Telemetry("bad-values")  # no Ray needed: recording before ray.init is a no-op in Ray
    tel.record_step({**bad, "rollout/reward_mean": float("inf")})
    assert tel.enabled
