"""The service's warm pool (`base_models[].warm`) and its admission (`cluster.serve.pool`), driven by the
real `tinker` SDK (tests/tinker_pool_client.py in `.venv-tinker`) against `python -m cluster.serve`.

- A pooled tenant is the tenant a cold start gives: one service serves the same base folder under two
  names, one with `warm: 1`, one without; a client on each (same rank, same LoRA seed) scores bit for
  bit the same before and after one forward_backward + optim_step. That the first came from the pool
  and the second started cold is the service's own log line for each (`tenant <id> (...): a warm pool
  actor` / `a new actor (cold start)`).
- Admission: the service joins this test's Ray (4 CPUs) with tenant_cpus 3 and `warm: 1`. The pool actor
  holds 3; the first client takes it (its replacement does not fit, so none starts); the second client
  can get no CPUs and is refused by the service, category user, with the message naming tenant_cpus,
  the cluster's CPUs and what the service holds (not a start that waits out start_timeout_s, which is
  set far beyond the test's own timeout). When that session ends, its tenant's actor goes (not back to
  the pool) and the pool refills: a new session's client takes the new pool actor.
- A pool actor killed while it waits (SIGKILL once the service says it loaded): the client that takes it
  gets a cold start instead, logged as such, equal to a cold tenant of the same seed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import psutil
import pytest
from serve_process import serving_process

REPO = Path(__file__).resolve().parent.parent
TINKER_PY = REPO / ".venv-tinker" / "bin" / "python"
KEY, MODEL, COLD = "tml-test-key", "tiny-gpt2", "tiny-gpt2-cold"


def test_room_counts_every_held_actor_and_absorbs_float_sums():
    """By hand: 4 CPUs, tenant_cpus 3: nothing held leaves 4 >= 3; one tenant (or one pool actor, or one
    sampling engine) leaves 1 < 3. 1 CPU, tenant_cpus 0.1, 9 held: 1 - 0.9 = 0.1 fits (in floats
    1 - 9 * 0.1 = 0.09999999999999987, which the epsilon admits); 10 held: 0 does not."""
    from cluster.serve.pool import Held, refusal, room

    assert room(4.0, Held(0, 0, 0), 3.0)
    assert not any(room(4.0, h, 3.0) for h in (Held(1, 0, 0), Held(0, 1, 0), Held(0, 0, 1)))
    assert room(1.0, Held(5, 3, 1), 0.1) and not room(1.0, Held(5, 3, 2), 0.1)
    msg = refusal(4.0, Held(1, 0, 0), 3.0)
    assert "tenant_cpus 3" in msg and "has 4 CPUs" in msg and "holds 3 of them" in msg, msg
    assert "(1 tenants, 0 warm pool actors, 0 sampling engines; 1 free)" in msg, msg


def test_warm_must_be_a_count():
    from pydantic import ValidationError

    from cluster.serve.config import ServeConfig

    with pytest.raises(ValidationError, match=r"base_models\.0\.warm"):
        ServeConfig(api_keys=[KEY], base_models=[{"name": MODEL, "path": "x", "warm": -1}])


def _client(scenario: str, url: str, *models: str) -> dict:
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    out = subprocess.run(
        [str(TINKER_PY), str(REPO / "tests" / "tinker_pool_client.py"), scenario, url, KEY, *models],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout + out.stderr
    return json.loads(lines[-1][len("RESULT ") :])


def _serve_log(config: dict, folder: Path, scenario: str, *models: str) -> tuple[dict, str]:
    """A scenario's result and what the service printed after `serving <url>` (read once it stopped)."""
    with serving_process(config, folder) as (url, proc):
        seen = _client(scenario, url, *models)
    return seen, proc.stdout.read()


@pytest.mark.slow
@pytest.mark.skipif(not TINKER_PY.exists(), reason="the tinker SDK's venv .venv-tinker is missing")
def test_a_pooled_tenant_equals_a_cold_one_bit_for_bit(tiny_policy_dir, tmp_path):
    path = str(tiny_policy_dir)
    config = {"api_keys": [KEY], "lora_alpha": 8.0, "tenant_cpus": 0.1,
              "base_models": [{"name": MODEL, "path": path, "warm": 1}, {"name": COLD, "path": path}]}  # fmt: skip
    seen, log = _serve_log(config, tmp_path, "pool", MODEL, COLD)
    warm, cold = seen["warm"], seen["cold"]
    assert f"tenant {warm['model_id']} ({MODEL}, rank 4, seed 7): a warm pool actor" in log, log
    assert f"tenant {cold['model_id']} ({COLD}, rank 4, seed 7): a new actor (cold start)" in log, log
    for when in ("before", "after"):
        np.testing.assert_array_equal(np.concatenate(warm[when]), np.concatenate(cold[when]))
    assert not np.array_equal(np.concatenate(warm["after"]), np.concatenate(warm["before"]))


@pytest.mark.slow
@pytest.mark.skipif(not TINKER_PY.exists(), reason="the tinker SDK's venv .venv-tinker is missing")
def test_a_tenant_the_cluster_cannot_fit_is_refused_at_once(tiny_policy_dir, tmp_path, ray_local):
    address = ray_local.get_runtime_context().gcs_address
    assert ray_local.cluster_resources()["CPU"] == 4.0
    config = {"api_keys": [KEY], "lora_alpha": 8.0, "tenant_cpus": 3.0, "ray_address": address,
              "start_timeout_s": 3600.0, "base_models": [{"name": MODEL, "path": str(tiny_policy_dir), "warm": 1}]}  # fmt: skip
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    with serving_process(config, tmp_path) as (url, service):
        client = subprocess.Popen(
            [str(TINKER_PY), str(REPO / "tests" / "tinker_pool_client.py"), "refused", url, KEY, MODEL],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        try:
            seen = []
            for line in client.stdout:
                seen.append(line)
                if line.startswith("CLOSED"):
                    break
            assert seen and seen[-1].startswith("CLOSED"), "".join(seen)
            log = []  # the first session's tenant released, the pool refills: its second actor loads
            second = f"warm pool {MODEL}: an actor has loaded its base model (2 so far)"
            for line in service.stdout:
                log.append(line)
                if line.startswith(second):
                    break
            assert log and log[-1].startswith(second), "".join(log)
            out, _ = client.communicate("go\n", timeout=600)
        finally:
            if client.poll() is None:
                client.kill()
        assert client.returncode == 0, "".join(seen) + out
    log = "".join(log) + service.stdout.read()
    seen = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    assert f"tenant {seen['first']} ({MODEL}, rank 2, seed 0): a warm pool actor" in log, log
    assert len(seen["first_forward"]) == 2  # the first tenant serves
    failed = seen["failed"]
    assert failed is not None and failed["type"] == "RequestFailedError", seen
    assert failed["category"] == "user", failed
    expected = (
        "create_model refused: no free CPUs for a new tenant (tenant_cpus 3): the Ray cluster has 4 CPUs "
        "and this service holds 3 of them (1 tenants, 0 warm pool actors, 0 sampling engines; 1 free)"
    )
    assert expected in failed["message"], failed
    # the released tenant's actor was not returned to the pool (an attached actor refuses a second
    # adapter): the new session's client takes the replacement, which scores as the first (same seed)
    assert f"tenant {seen['later']} ({MODEL}, rank 2, seed 0): a warm pool actor" in log, log
    np.testing.assert_array_equal(
        np.concatenate(seen["later_forward"]), np.concatenate(seen["first_forward"])
    )


@pytest.mark.slow
@pytest.mark.skipif(not TINKER_PY.exists(), reason="the tinker SDK's venv .venv-tinker is missing")
def test_a_dead_pool_actor_is_replaced_by_a_cold_start(tiny_policy_dir, tmp_path):
    """The pool actor, once loaded (the service's line), is SIGKILLed: the client that takes it gets a
    cold-started tenant instead, logged as such, still equal to a cold one of the same seed."""
    from test_tinker_recovery import _actor_processes, _kill

    path = str(tiny_policy_dir)
    config = {"api_keys": [KEY], "lora_alpha": 8.0, "tenant_cpus": 0.1,
              "base_models": [{"name": MODEL, "path": path, "warm": 1}, {"name": COLD, "path": path}]}  # fmt: skip
    with serving_process(config, tmp_path) as (url, proc):
        for line in proc.stdout:
            if line.startswith(f"warm pool {MODEL}: "):
                assert "has loaded its base model" in line, line
                break
        victims = _actor_processes(psutil.Process(proc.pid), "TenantModel")
        assert len(victims) == 1, [" ".join(p.cmdline()) for p in victims]
        _kill(victims)
        seen = _client("pool", url, MODEL, COLD)
    log = proc.stdout.read()
    warm, cold = seen["warm"], seen["cold"]
    assert f"warm pool {MODEL}: the actor taken had died (" in log, log
    assert f"tenant {warm['model_id']} ({MODEL}, rank 4, seed 7): a new actor (cold start)" in log, log
    for when in ("before", "after"):
        np.testing.assert_array_equal(np.concatenate(warm[when]), np.concatenate(cold[when]))
