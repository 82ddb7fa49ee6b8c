"""The `tinker` SDK side of bench/bench_serve.py, run in `.venv-tinker` (the SDK is not in the project's
venv). Prints one line `RESULT <json>`: what it timed (wall seconds, `time.perf_counter`).

    .venv-tinker/bin/python bench/serve_client.py warm BASE_URL API_KEY MODEL PROMPT_JSON
    .venv-tinker/bin/python bench/serve_client.py throughput BASE_URL API_KEY MODEL DATA_JSON CALLS

warm: a new ServiceClient (its session: `session_s`), then two LoRA training clients one after the
other, each timed from its `create_lora_training_client` call: the first to its first `forward_backward`
done (`create_s` of it is the model's creation alone), the second to its first `sample` done (through
`save_weights_and_get_sampling_client`); the session is closed after (its tenants released).
throughput: one training client, one warm-up `forward_backward`, then CALLS of them sent at once (the
SDK pipelines them; the service runs a model's calls in seq_id order) and waited for; `fb_s` is from
the first send to the last result.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import tinker
from tinker import types


def datum(tokens: list[int]) -> types.Datum:
    """Next-token cross-entropy on `tokens` (input tokens[:-1], targets tokens[1:], weight 1)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


def warm(base_url: str, key: str, model: str, prompt_json: str) -> dict:
    prompt = json.loads(prompt_json)
    t0 = time.perf_counter()
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    session_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        tc = client.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        create_s = time.perf_counter() - t0
        tc.forward_backward([datum(prompt)], "cross_entropy").result()
        first_fb_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        tc2 = client.create_lora_training_client(base_model=model, rank=8, seed=1).result()
        sampler = tc2.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=8, seed=0, temperature=1.0)
        sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
        first_sample_s = time.perf_counter() - t0
    finally:
        client.close("success").result()
    return {
        "session_s": session_s,
        "create_s": create_s,
        "first_fb_s": first_fb_s,
        "first_sample_s": first_sample_s,
    }


def throughput(base_url: str, key: str, model: str, data_json: str, calls: str) -> dict:
    data = [datum(row) for row in json.loads(data_json)]
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    try:
        tc = client.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        tc.forward_backward(data, "cross_entropy").result()  # warm-up
        t0 = time.perf_counter()
        futures = [tc.forward_backward(data, "cross_entropy") for _ in range(int(calls))]
        for f in futures:
            f.result()
        fb_s = time.perf_counter() - t0
    finally:
        client.close("success").result()
    return {"fb_s": fb_s, "calls": int(calls)}


SCENARIOS = {"warm": warm, "throughput": throughput}


def main() -> None:
    scenario, *args = sys.argv[1:]
    print("RESULT " + json.dumps(SCENARIOS[scenario](*args)), flush=True)
    # The session is closed and the result printed: leave without the interpreter's shutdown, where the
    # SDK's background threads once ended the process with a non-zero status after a complete result.
    os._exit(0)


if __name__ == "__main__":
    main()
