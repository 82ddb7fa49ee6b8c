"""Scenarios of tests/test_tinker_recovery.py, written with the real `tinker` SDK and run in `.venv-tinker`
(as tests/tinker_client.py, whose helpers they use):

    .venv-tinker/bin/python tests/tinker_recovery_client.py SCENARIO BASE_URL API_KEY MODEL

Each prints `KILL <model ids>` once it is ready for the test to kill an actor, waits for a line on stdin
(the test writes it once the killed process has exited), goes on, and prints one `RESULT <json>` line.
"""

from __future__ import annotations

import json
import sys

import tinker
from tinker import types
from tinker_client import _draw, _step, error, logprobs, sft_data


def _forward(tc) -> list[list[float]]:
    return logprobs(tc.forward(sft_data(), "cross_entropy").result())


def _fails(call) -> dict | None:
    try:
        call().result()
    except Exception as e:  # noqa: BLE001 - the scenario reports whatever the SDK raised
        return {**error(e), "category": str(getattr(e, "category", None))}
    return None


def _killed(*model_ids: str) -> None:
    print("KILL " + " ".join(model_ids), flush=True)
    sys.stdin.readline()


def tenant(client, model: str) -> dict:
    """A client trained 2 steps and saved (save_state), then one step more; a second client never saved.
    After the test kills both tenants' actors: a forward_backward on each fails; the saved one then
    scores as at its save, and one more step on it moves it as on a client created from that save with
    its optimizer; the unsaved one keeps failing."""
    tc = client.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    lone = client.create_lora_training_client(base_model=model, rank=2, seed=0).result()
    for _ in range(2):
        _step(tc)
    saved = tc.save_state("two-steps").result().path
    at_save = _forward(tc)
    _step(tc)  # lost with the actor
    before_kill = _forward(tc)
    _killed(tc.get_info().model_id, lone.get_info().model_id)
    failed = _fails(lambda: tc.forward_backward(sft_data(), "cross_entropy"))
    after = _forward(tc)
    _step(tc)
    stepped = _forward(tc)
    ref = client.create_training_client_from_state_with_optimizer(saved).result()
    _step(ref)
    lone_errors = [_fails(lambda: lone.forward_backward(sft_data(), "cross_entropy")) for _ in range(2)]
    return {
        "saved": saved, "at_save": at_save, "before_kill": before_kill, "failed": failed, "after": after,
        "stepped": stepped, "ref_stepped": _forward(ref), "lone": lone_errors,
        "model_ids": [tc.get_info().model_id, lone.get_info().model_id],
    }  # fmt: skip


def engine(client, model: str) -> dict:
    """A sampling client drawn once; after the test kills the session's sampling engine, a sample fails
    and the next one (a new engine, the snapshot loaded again) draws the same as the first (same seed)."""
    tc = client.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    _step(tc)
    sc = tc.save_weights_and_get_sampling_client().result()
    first = _draw(sc, [1, 4, 5])
    _killed(tc.get_info().model_id)
    params = types.SamplingParams(max_tokens=5, seed=11)
    failed = _fails(lambda: sc.sample(types.ModelInput.from_ints([1, 4, 5]), 3, params))
    return {"first": first, "failed": failed, "again": _draw(sc, [1, 4, 5])}


def main() -> None:
    scenario, base_url, api_key, model = sys.argv[1:]
    client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    out = {"tenant": tenant, "engine": engine}[scenario](client, model)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
