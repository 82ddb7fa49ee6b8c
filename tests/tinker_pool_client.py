"""Scenarios of tests/test_tinker_pool.py, written with the real `tinker` SDK and run in `.venv-tinker`
(as tests/tinker_client.py, whose helpers they use):

    .venv-tinker/bin/python tests/tinker_pool_client.py SCENARIO BASE_URL API_KEY MODEL [MODEL2]

prints one `RESULT <json>` line: what the scenario observed (`refused` prints `CLOSED` midway and waits
for a line on stdin).
"""

from __future__ import annotations

import json
import sys

import tinker
from tinker_client import _step, error, logprobs, sft_data


def _forward(tc) -> list[list[float]]:
    return logprobs(tc.forward(sft_data(), "cross_entropy").result())


def _observed(tc) -> dict:
    """A client's forward logprobs, then its forward after one forward_backward + optim_step."""
    before = _forward(tc)
    _step(tc)
    return {"model_id": tc.get_info().model_id, "before": before, "after": _forward(tc)}


def pool(client, warm_model: str, cold_model: str) -> dict:
    """A client on `warm_model` (the service's warm pool actor) and one on `cold_model` (the same base
    folder, no pool: a cold start), the same rank and LoRA seed; each scored, stepped once, scored."""
    warm = client.create_lora_training_client(base_model=warm_model, rank=4, seed=7).result()
    cold = client.create_lora_training_client(base_model=cold_model, rank=4, seed=7).result()
    return {"warm": _observed(warm), "cold": _observed(cold)}


def refused(client, model: str, base_url: str, api_key: str) -> dict:
    """One client (it fits), then a second one on a cluster with no CPUs left for it: the SDK's error.
    Then the session is closed (its tenant released), `CLOSED` printed, and after a line on stdin (the
    test writes it once the service says a new pool actor loaded) a new session's client is created."""
    first = client.create_lora_training_client(base_model=model, rank=2, seed=0).result()
    try:
        client.create_lora_training_client(base_model=model, rank=2, seed=1).result()
    except Exception as e:  # noqa: BLE001 - the scenario reports whatever the SDK raised
        failed = {**error(e), "category": str(getattr(e, "category", None))}
    else:
        failed = None
    out = {"first": first.get_info().model_id, "failed": failed, "first_forward": _forward(first)}
    client.close("success").result()
    print("CLOSED", flush=True)
    sys.stdin.readline()
    again = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    later = again.create_lora_training_client(base_model=model, rank=2, seed=0).result()
    return out | {"later": later.get_info().model_id, "later_forward": _forward(later)}


def main() -> None:
    scenario, base_url, api_key, *models = sys.argv[1:]
    client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    if scenario == "pool":
        out = pool(client, *models)
    else:
        out = refused(client, *models, base_url, api_key)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
