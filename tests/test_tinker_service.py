"""`python -m cluster.serve` driven by the real `tinker` SDK (tests/tinker_client.py, run in
`.venv-tinker`: `make test-tinker` makes it) and by raw HTTP, on a tiny GPT-2 built here.

What is compared, and with what: a LoRA client's first `forward` logprobs with a plain transformers
forward of the base model (the adapter starts at B = 0); training with cross_entropy lowers the loss
and moves the logprobs; importance_sampling on policy with advantages 1 is minus the token count
(ratio 1, worked by hand); an unknown loss name and base model are refused by name; a wrong key is a
401; a sampling client samples the adapter it was saved with (sampled logprobs = teacher-forced ones);
two tenants (the async SDK) stay apart: training one never moves the other; an unknown route a
404 naming it; a forward_backward sent twice (same seq_id, another idempotency key) is applied once:
the optimizer's gradient norm equals that of a tenant that got it once; a session whose heartbeats
stop is ended (its tenant and sampler gone) while an SDK client's heartbeating session is kept.
The parts that need no running service are tested on their own: tests/test_serve_futures.py,
test_serve_losses.py, test_serve_checkpoint_store.py and test_serve_sessions.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from serve_process import serving

from cluster.serve.wire import FwdBwdRequest, WireDatum, encode_forward_backward

REPO = Path(__file__).resolve().parent.parent
TINKER_PY = REPO / ".venv-tinker" / "bin" / "python"
KEY, MODEL = "tml-test-key", "tiny-gpt2"
OTHER_KEY = "tml-other-key"  # a second tenant's key: it must never reach KEY's checkpoints

slow = pytest.mark.slow  # starts the service and its Ray
needs_sdk = pytest.mark.skipif(
    not TINKER_PY.exists(), reason="the tinker SDK's venv .venv-tinker is missing (make test-tinker makes it)"
)


def _serve(tiny_policy_dir, folder: Path, **more):
    """The service (tests/serve_process.py) on the tiny policy, with both test keys."""
    config = {
        "api_keys": [KEY, OTHER_KEY],
        "base_models": [{"name": MODEL, "path": str(tiny_policy_dir)}],
        "lora_alpha": 8.0,
        "tenant_cpus": 0.1,  # logical: the module's tenants and samplers stay until their sessions end
    }
    with serving(config | more, folder) as url:
        yield url


@pytest.fixture(scope="module")
def serve_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def service(tiny_policy_dir, serve_folder):
    yield from _serve(tiny_policy_dir, serve_folder)


HEARTBEAT_TIMEOUT_S = 30.0  # the SDK heartbeats every 10 s: a live session never comes near it


@pytest.fixture(scope="module")
def short_service(tiny_policy_dir, tmp_path_factory):
    """A service whose sessions end after HEARTBEAT_TIMEOUT_S without a heartbeat."""
    folder = tmp_path_factory.mktemp("serve-short")
    yield from _serve(tiny_policy_dir, folder, session_timeout_s=HEARTBEAT_TIMEOUT_S)


def run_client(scenario: str, url: str, key: str = KEY, *args: str, model: str = MODEL) -> dict:
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    out = subprocess.run(
        [str(TINKER_PY), str(REPO / "tests" / "tinker_client.py"), scenario, url, key, model, *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout + out.stderr
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def trained(service) -> dict:
    return run_client("train", service)


def plain_logprobs(model_dir: Path, tokens: list[int], targets: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return logits.log_softmax(-1)[torch.arange(len(targets)), torch.tensor(targets)].tolist()


@slow
@needs_sdk
def test_forward_logprobs_equal_a_plain_transformers_forward(trained, tiny_policy_dir):
    for (tokens, targets, _), got in zip(trained["data"], trained["first_logprobs"], strict=True):
        np.testing.assert_allclose(got, plain_logprobs(tiny_policy_dir, tokens, targets), atol=1e-5, rtol=0)
    # cross_entropy's loss is -sum w * lp over the batch (Tinker's sum, not a mean)
    expect = -sum(
        np.dot(w, lp) for (_, _, w), lp in zip(trained["data"], trained["first_logprobs"], strict=True)
    )
    assert trained["first_loss"] == pytest.approx(expect, abs=1e-4)
    assert trained["info"]["lora_rank"] == 4 and trained["info"]["model_id"].endswith(":train:0")


@slow
@needs_sdk
def test_forward_backward_and_optim_step_lower_the_loss(trained):
    assert trained["train_losses"][0] == pytest.approx(trained["first_loss"], abs=1e-5)  # nothing moved yet
    assert trained["after_loss"] < trained["first_loss"] - 0.1
    assert not np.allclose(
        np.concatenate(trained["after_logprobs"]), np.concatenate(trained["first_logprobs"])
    )


@slow
@needs_sdk
def test_each_optim_step_is_a_row_of_the_tenants_tracker_run(trained, serve_folder):
    """The train scenario: forward, then 3 x (forward_backward + optim_step at lr 0.05), forward, and a
    forward_backward with no step after it (no row); the rows are under the folder's tenants/
    (tests/serve_process.py sets tracking.dir there)."""
    from cluster.serve.tenant_metrics import TenantMetrics, TrackingSection

    folder = TenantMetrics(TrackingSection(dir=str(serve_folder / "tenants"))).folder(
        KEY, trained["info"]["model_id"]
    )
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["fb/loss:sum"] for r in rows] == pytest.approx(trained["train_losses"], abs=1e-6)
    tokens = sum(len(t) for t, _, _ in trained["data"])
    for i, row in enumerate(rows):
        assert (row["fb/calls"], row["fb/data"], row["fb/tokens"]) == (1, len(trained["data"]), tokens)
        assert row["forward/calls"] == (1 if i == 0 else 0)
        assert row["optim/learning_rate"] == pytest.approx(0.05) and row["optim/step:max"] == i + 1
        assert row["optim/grad_norm:mean"] > 0


@slow
@needs_sdk
def test_importance_sampling_on_policy_is_minus_the_advantage_sum(trained):
    # behaviour logprobs = the current policy's, so every ratio is 1: L = -sum_t 1 * A_t = -(5 + 4)
    assert trained["is_loss"] == pytest.approx(-9.0, abs=1e-5)
    np.testing.assert_allclose(
        np.concatenate(trained["is_logprobs"]), np.concatenate(trained["after_logprobs"]), atol=1e-6
    )


@slow
@needs_sdk
def test_two_tenants_through_the_async_sdk_stay_apart(service):
    seen = run_client("tenants", service)
    (a0, b0), (a1, b1) = seen["before"], seen["after"]
    assert len(set(seen["model_ids"])) == 2
    np.testing.assert_array_equal(np.concatenate(a0), np.concatenate(b0))  # same base, same LoRA seed
    np.testing.assert_array_equal(np.concatenate(b1), np.concatenate(b0))  # A's steps never reach B
    assert not np.allclose(np.concatenate(a1), np.concatenate(a0))


@slow
@needs_sdk
def test_sampling_client_samples_the_acknowledged_adapter(service):
    """save_weights_and_get_sampling_client after 2 steps: each sampled token's logprob (temperature 1,
    no truncation: the full distribution) equals the training client's teacher-forced logprob of it on
    the same weights, the prompt logprobs too (NaN, read as None, at position 0); a later step and a
    second snapshot on the same engine leave the first snapshot as it was (same seed, same samples)."""
    seen = run_client("sample", service)
    p, first = len(seen["prompt"]), seen["first"]
    assert len(first["sequences"]) == 3 and len({q["id"] for q in first["sequences"]}) == 3
    for q, forced in zip(first["sequences"], seen["teacher_forced"], strict=True):
        assert 1 <= len(q["tokens"]) <= 5 and q["stop"] in ("stop", "length")
        np.testing.assert_allclose(q["logprobs"], forced[p - 1 :], atol=1e-5, rtol=0)
        np.testing.assert_allclose(first["prompt_logprobs"][1:], forced[: p - 1], atol=1e-5, rtol=0)
    assert first["prompt_logprobs"][0] is None
    second = seen["second"]["sequences"]  # the newer adapter: other numbers
    assert [q["logprobs"] for q in second] != [q["logprobs"] for q in first["sequences"]]
    again = seen["again"]["sequences"]
    assert [q["tokens"] for q in again] == [q["tokens"] for q in first["sequences"]]
    np.testing.assert_array_equal([q["logprobs"] for q in again], [q["logprobs"] for q in first["sequences"]])


@slow
@needs_sdk
def test_unknown_loss_and_model_are_refused_by_name(service):
    seen = run_client("refusals", service)
    loss = seen["unknown_loss"]
    assert loss["type"] == "RequestFailedError"
    assert "'no_such_loss'" in loss["message"] and "cross_entropy, importance_sampling" in loss["message"]
    assert "'no-such-model'" in seen["unknown_model"]["message"] and MODEL in seen["unknown_model"]["message"]


@slow
@needs_sdk
def test_wrong_api_key_is_a_401(service):
    err = run_client("wrong_key", service, key="tml-not-a-key")["error"]
    assert err["status"] == 401 and err["type"] == "AuthenticationError"


@pytest.fixture(scope="module")
def saved(service) -> dict:
    return run_client("checkpoints", service)


@slow
@needs_sdk
def test_a_loaded_state_scores_bit_for_bit_as_the_saved_client(saved):
    """save_state after 2 steps; create_training_client_from_state(_with_optimizer) and load_state onto
    an existing client (another LoRA seed: other logprobs before) all give the saved client's logprobs,
    bit for bit."""
    ref = np.concatenate(saved["loaded"]["saved"])
    assert (
        saved["paths"]["weights"].startswith("tinker://")
        and "/weights/two-steps" in saved["paths"]["weights"]
    )
    assert not np.array_equal(np.concatenate(saved["onto_before"]), ref)
    for name in ("with_opt", "without", "onto"):
        np.testing.assert_array_equal(np.concatenate(saved["loaded"][name]), ref, err_msg=name)


@slow
@needs_sdk
def test_the_optimizer_state_travels_with_the_checkpoint(saved):
    """One more identical step: with the AdamW moments and step count restored the adapter moves exactly
    as the saved client's; with a fresh optimizer (load without it) it moves otherwise (Adam's first
    step is lr * g/|g| per element, not the third step's bias-corrected moments)."""
    ref = np.concatenate(saved["stepped"]["saved"])
    np.testing.assert_array_equal(np.concatenate(saved["stepped"]["with_opt"]), ref)
    np.testing.assert_array_equal(np.concatenate(saved["stepped"]["onto"]), ref)
    assert not np.allclose(np.concatenate(saved["stepped"]["without"]), ref, atol=1e-4)
    assert not np.array_equal(ref, np.concatenate(saved["loaded"]["saved"]))  # the step moved it
    assert sorted(saved["listed"]) == [
        ["sampler_weights/two-steps", "sampler", saved["paths"]["sampler"]],
        ["weights/two-steps", "training", saved["paths"]["weights"]],
    ]  # RestClient.list_checkpoints of the run
    err = saved["errors"]["exists"]  # a name is not overwritten unless asked
    assert "'tinker://" in err["message"] and "exists" in err["message"]


@slow
@needs_sdk
def test_a_named_sampler_checkpoint_samples_what_the_training_client_had(saved):
    p = len(saved["prompt"])
    assert saved["sampler_base_model"] == MODEL
    assert "/sampler_weights/two-steps" in saved["paths"]["sampler"]
    for q, forced in zip(saved["drawn"]["sequences"], saved["teacher_forced"], strict=True):
        np.testing.assert_allclose(q["logprobs"], forced[p - 1 :], atol=1e-5, rtol=0)
        np.testing.assert_allclose(saved["drawn"]["prompt_logprobs"][1:], forced[: p - 1], atol=1e-5, rtol=0)


@slow
@needs_sdk
def test_another_key_cannot_load_or_sample_a_checkpoint(service, saved):
    """OTHER_KEY is told KEY's checkpoints do not exist (the path named), whichever route it takes, and
    lists none of them."""
    paths = saved["paths"]
    seen = run_client("foreign", service, OTHER_KEY, paths["weights"], paths["sampler"])
    for route, path in (
        ("load", paths["weights"]),
        ("load_onto", paths["weights"]),
        ("sample", paths["sampler"]),
    ):
        assert f"checkpoint {path!r} does not exist" in seen[route]["message"], (route, seen[route])


def _call(url: str, path: str, body: dict | bytes | None = None, key: str | None = KEY, **headers):
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    ctype = "application/x-protobuf" if isinstance(body, bytes) else "application/json"
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", ctype)
    if key:
        req.add_header("X-API-Key", key)
    for k, v in headers.items():
        req.add_header(k.replace("_", "-"), v)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _result(url: str, request_id: str) -> bytes:
    while True:  # the service long-polls; try_again means it is still running
        status, raw = _call(url, "/api/v1/retrieve_future", {"request_id": request_id})
        assert status == 200, raw
        if not raw.startswith(b"{") or json.loads(raw).get("type") != "try_again":
            return raw


@slow
def test_unknown_route_and_missing_key(service):
    status, raw = _call(service, "/api/v1/sample", {"x": 1})
    assert status == 404 and b"POST /api/v1/sample is not served" in raw
    assert _call(service, "/api/v1/get_server_capabilities", key=None)[0] == 401
    assert _call(service, "/api/v1/healthz", key=None) == (200, b'{"status":"ok"}')


def _tenant(url: str) -> str:
    sid = json.loads(_call(url, "/api/v1/create_session", {"tags": [], "sdk_version": "raw"})[1])[
        "session_id"
    ]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2, "seed": 3}}
    rid = json.loads(_call(url, "/api/v1/create_model", body)[1])["request_id"]
    return json.loads(_result(url, rid))["model_id"]


@slow
def test_finishing_a_session_ends_its_tenants_and_samplers(service):
    model_id = _tenant(service)
    sid = model_id.split(":train:")[0]
    rid = json.loads(
        _call(service, "/api/v1/save_weights_for_sampler", {"model_id": model_id, "seq_id": 1})[1]
    )
    sampler = json.loads(_result(service, rid["request_id"]))["sampling_session_id"]
    assert _call(service, f"/api/v1/sessions/{sid}/finish", {"reason": {"type": "success"}})[0] == 200
    assert _call(service, "/api/v1/session_heartbeat", {"session_id": sid})[0] == 410
    step = {"model_id": model_id, "seq_id": 2, "adam_params": {}}
    status, raw = _call(service, "/api/v1/optim_step", step)
    assert status == 404 and f"unknown model_id {model_id!r}".encode() in raw
    body = {
        "sampling_session_id": sampler,
        "prompt": {"chunks": [{"tokens": [1, 4]}]},
        "sampling_params": {"max_tokens": 2},
    }
    status, raw = _call(service, "/api/v1/asample", body)
    assert status == 404 and b"unknown sampling_session_id" in raw


@slow
def test_a_resent_forward_backward_is_applied_once(service):
    data = [
        WireDatum(
            np.array([1, 4, 5]), {"target_tokens": np.array([4, 5, 2]), "weights": np.ones(3, np.float32)}
        )
    ]
    norms = []
    for sends in (1, 2):
        model_id = _tenant(service)
        body = encode_forward_backward(FwdBwdRequest(model_id, 1, "cross_entropy", {}, False, data))
        rids = {
            json.loads(
                _call(service, "/api/v1/forward_backward", body, X_Idempotency_Key=f"{model_id}-{i}")[1]
            )["request_id"]
            for i in range(sends)
        }
        assert len(rids) == 1  # the resend answers the first call's future
        _result(service, rids.pop())
        step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}
        rid = json.loads(_call(service, "/api/v1/optim_step", step)[1])["request_id"]
        norms.append(json.loads(_result(service, rid))["metrics"]["grad_norm:mean"])
    # gradients accumulate until optim_step: a second application would double the norm
    assert norms[1] == pytest.approx(norms[0], rel=1e-6) and norms[0] > 0


@slow
@needs_sdk
def test_loading_a_checkpoint_of_another_rank_is_refused_naming_both(service, saved):
    model_id = _tenant(service)  # rank 2; the saved checkpoint is rank 4
    body = {"model_id": model_id, "seq_id": 1, "path": saved["paths"]["weights"], "optimizer": True}
    rid = json.loads(_call(service, "/api/v1/load_weights", body)[1])["request_id"]
    err = json.loads(_result(service, rid))
    assert err["category"] == "user" and "rank-4 adapter on 'tiny-gpt2'" in err["error"]
    assert f"model {model_id!r} is rank 2" in err["error"]


@slow
@needs_sdk
def test_a_session_whose_heartbeats_stop_is_ended_and_a_heartbeating_one_is_kept(short_service):
    """An SDK client (its heartbeats running) and then a raw-HTTP session that never heartbeats, each
    with a tenant (the raw one with a sampler too). Once the service ends the raw session (polled on its
    own GET sessions/{id}, no sleep racing the timer), the SDK's session, older than it and so older
    than session_timeout_s, is still listed with its tenant, and the client still trains; the raw
    session's tenant and sampler are gone as a finished session's are."""
    url = short_service
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    sdk = subprocess.Popen(
        [str(TINKER_PY), str(REPO / "tests" / "tinker_client.py"), "idle", url, KEY, MODEL],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        seen = []
        for line in sdk.stdout:
            seen.append(line)
            if line.startswith("MODEL "):
                break
        assert seen and seen[-1].startswith("MODEL "), "".join(seen)
        sdk_model = seen[-1].split()[1]
        sdk_sid = sdk_model.split(":train:")[0]
        raw_model = _tenant(url)
        raw_sid = raw_model.split(":train:")[0]
        rid = json.loads(
            _call(url, "/api/v1/save_weights_for_sampler", {"model_id": raw_model, "seq_id": 1})[1]
        )
        sampler = json.loads(_result(url, rid["request_id"]))["sampling_session_id"]
        status, raw = _call(url, f"/api/v1/sessions/{raw_sid}")
        assert status == 200 and json.loads(raw) == {
            "training_run_ids": [raw_model],
            "sampler_ids": [sampler],
        }

        deadline = time.monotonic() + 10 * HEARTBEAT_TIMEOUT_S  # generous: the machine may be loaded
        while status == 200 and time.monotonic() < deadline:
            status, raw = _call(url, f"/api/v1/sessions/{raw_sid}")
            time.sleep(0.5)  # the poll's pace, not a synchronisation
        assert status == 410, (status, raw)
        assert (
            f"no heartbeat for more than {HEARTBEAT_TIMEOUT_S:g}s (session_timeout_s)"
            in json.loads(raw)["detail"]
        )
        assert _call(url, "/api/v1/session_heartbeat", {"session_id": raw_sid})[0] == 410
        step = {"model_id": raw_model, "seq_id": 2, "adam_params": {}}
        assert _call(url, "/api/v1/optim_step", step)[0] == 404
        body = {"sampling_session_id": sampler, "prompt": {"chunks": [{"tokens": [1, 4]}]},
                "sampling_params": {"max_tokens": 2}}  # fmt: skip
        assert _call(url, "/api/v1/asample", body)[0] == 404

        status, raw = _call(url, f"/api/v1/sessions/{sdk_sid}")
        assert status == 200 and json.loads(raw)["training_run_ids"] == [sdk_model]
        listed = json.loads(_call(url, "/api/v1/sessions")[1])["sessions"]
        assert sdk_sid in listed and raw_sid not in listed
        out, _ = sdk.communicate("go\n", timeout=300)
    finally:
        if sdk.poll() is None:
            sdk.kill()
    assert sdk.returncode == 0, out
    result = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    assert len(result["logprobs"]) == 2  # the kept client's forward ran
