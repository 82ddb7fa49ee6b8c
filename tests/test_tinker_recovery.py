"""A dead tenant or sampling engine of `python -m cluster.serve`, killed for real (SIGKILL of its Ray
actor's process, found by its process title `ray::TenantModel` / `ray::HFEngine` among the service's
descendants), driven by the real `tinker` SDK (tests/tinker_recovery_client.py in `.venv-tinker`).

What is checked: the call that reaches the dead tenant fails (`RequestFailedError`, category server)
naming the tenant, the death and the checkpoint it was restored from with its step; the restored
tenant scores bit for bit as at its `save_state`, and one more step moves it exactly as a client
created from that save with its optimizer (so the AdamW state is the saved one); a tenant with no saved
state keeps failing, saying so. A killed sampling engine fails the sample that reaches it, and the
next sample (a new engine, the snapshot loaded again and acknowledged) draws what the first engine
drew with the same seed. A sampling engine still starting when its session ends is killed, and the
snapshot that started it fails naming the ended session (the leak this fixed: it used to start and
live on).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from serve_process import serving, serving_process
from test_tinker_service import _call, _result, _tenant

REPO = Path(__file__).resolve().parent.parent
TINKER_PY = REPO / ".venv-tinker" / "bin" / "python"
KEY, MODEL = "tml-test-key", "tiny-gpt2"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TINKER_PY.exists(), reason="the tinker SDK's venv .venv-tinker is missing"),
]


def _config(tiny_policy_dir, **more) -> dict:
    return {"api_keys": [KEY], "base_models": [{"name": MODEL, "path": str(tiny_policy_dir)}],
            "lora_alpha": 8.0, "tenant_cpus": 0.1, **more}  # fmt: skip


def _actor_processes(root: psutil.Process, cls: str) -> list[psutil.Process]:
    """`root`'s descendants whose process title is a Ray actor of class `cls` (`ray::<cls>[.<method>]`)."""
    found = []
    for p in root.children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title == f"ray::{cls}" or title.startswith((f"ray::{cls}.", f"ray::{cls} ")):
            found.append(p)
    return found


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        p.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(procs, timeout=120)
    assert not alive, alive


def _drive(
    scenario: str, url: str, service: subprocess.Popen, cls: str, count: int
) -> tuple[list[str], dict]:
    """Run a scenario; when it says KILL, SIGKILL the `count` actors of class `cls` and let it go on."""
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    client = subprocess.Popen(
        [str(TINKER_PY), str(REPO / "tests" / "tinker_recovery_client.py"), scenario, url, KEY, MODEL],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        seen = []
        for line in client.stdout:
            seen.append(line)
            if line.startswith("KILL "):
                break
        assert seen and seen[-1].startswith("KILL "), "".join(seen)
        victims = _actor_processes(psutil.Process(service.pid), cls)
        assert len(victims) == count, (cls, [" ".join(p.cmdline()) for p in victims])
        _kill(victims)
        out, _ = client.communicate("go\n", timeout=600)
    finally:
        if client.poll() is None:
            client.kill()
    assert client.returncode == 0, "".join(seen) + out
    result = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return seen[-1].split()[1:], json.loads(result[len("RESULT ") :])


def test_a_killed_tenant_is_restored_from_its_last_save_and_an_unsaved_one_is_lost(tiny_policy_dir, tmp_path):
    with serving_process(_config(tiny_policy_dir), tmp_path) as (url, service):
        (saved_id, lone_id), seen = _drive("tenant", url, service, "TenantModel", 2)
    failed = seen["failed"]
    assert failed["type"] == "RequestFailedError" and failed["category"] == "server", failed
    assert f"tenant {saved_id!r}: its actor died (ActorDiedError" in failed["message"], failed
    assert seen["saved"] == f"tinker://{saved_id}/weights/two-steps"
    restored = (
        f"restored it from checkpoint {seen['saved']!r} (saved after optim_step 2; with its optimizer state)"
    )
    assert restored in failed["message"], failed
    # the restored state is the saved one, bit for bit; the step after the save is gone
    np.testing.assert_array_equal(np.concatenate(seen["after"]), np.concatenate(seen["at_save"]))
    assert not np.allclose(np.concatenate(seen["before_kill"]), np.concatenate(seen["at_save"]))
    # one more step: as a client created from the save with its optimizer (AdamW moments, step count)
    np.testing.assert_array_equal(np.concatenate(seen["stepped"]), np.concatenate(seen["ref_stepped"]))
    assert not np.array_equal(np.concatenate(seen["stepped"]), np.concatenate(seen["at_save"]))
    for err in seen["lone"]:  # not re-initialised: every call fails, saying why
        assert err is not None and err["category"] == "server", err
        assert f"tenant {lone_id!r}: its actor died" in err["message"], err
        assert "No state was saved for it" in err["message"] and "not re-initialised" in err["message"], err


def test_a_killed_sampling_engine_fails_its_sample_and_the_next_one_restarts_it(tiny_policy_dir, tmp_path):
    with serving_process(_config(tiny_policy_dir), tmp_path) as (url, service):
        _, seen = _drive("engine", url, service, "HFEngine", 1)
    failed = seen["failed"]
    assert failed["type"] == "RequestFailedError" and failed["category"] == "server", failed
    assert "asample: the sampling engine died (ActorDiedError" in failed["message"], failed
    assert "nothing was drawn" in failed["message"], failed
    first, again = seen["first"]["sequences"], seen["again"]["sequences"]
    assert [q["tokens"] for q in again] == [q["tokens"] for q in first]
    np.testing.assert_array_equal([q["logprobs"] for q in again], [q["logprobs"] for q in first])
    assert seen["again"]["prompt_logprobs"][1:] == seen["first"]["prompt_logprobs"][1:]


def _engines(ray) -> dict[str, str]:
    """Actor id -> state of every HFEngine actor on this test's Ray cluster (its GCS actor table)."""
    from ray._private.state import actors

    return {k: v["State"] for k, v in actors().items() if v["ActorClassName"] == "HFEngine"}


def test_an_engine_still_starting_when_its_session_ends_is_killed(tiny_policy_dir, tmp_path, ray_local):
    """The service joins this test's Ray (4 CPUs) with tenant_cpus 3: the tenant holds 3, so the
    session's sampling engine (3 more) stays pending, starting, until the session is finished. Seen in
    Ray's actor table (the service asked Ray for it), the session is finished: the snapshot fails naming
    the ended session and the engine is dead, never started (it used to start once the tenant's CPUs
    were freed and live on)."""
    address = ray_local.get_runtime_context().gcs_address
    before = set(_engines(ray_local))
    with serving(_config(tiny_policy_dir, tenant_cpus=3.0, ray_address=address), tmp_path) as url:
        model_id = _tenant(url)
        sid = model_id.split(":train:")[0]
        rid = json.loads(
            _call(url, "/api/v1/save_weights_for_sampler", {"model_id": model_id, "seq_id": 1})[1]
        )
        deadline = time.monotonic() + 300
        while not (pending := set(_engines(ray_local)) - before) and time.monotonic() < deadline:
            time.sleep(0.2)  # the poll's pace, not a synchronisation: the event is the engine in Ray's table
        assert len(pending) == 1, pending
        (engine,) = pending
        assert _engines(ray_local)[engine] in ("DEPENDENCIES_UNREADY", "PENDING_CREATION"), _engines(
            ray_local
        )
        assert _call(url, f"/api/v1/sessions/{sid}/finish", {"reason": {"type": "success"}})[0] == 200
        err = json.loads(_result(url, rid["request_id"]))
        assert err["category"] == "user", err
        assert (
            "the session ended while its sampling engine started; the engine was stopped" in err["error"]
        ), err
        assert _engines(ray_local)[engine] == "DEAD"
        assert not _actor_processes(psutil.Process(), "HFEngine")
