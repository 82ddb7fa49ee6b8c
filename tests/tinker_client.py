"""A client of `cluster.serve` written with the real `tinker` SDK, run in `.venv-tinker` by
tests/test_tinker_service.py (the SDK is not installed in the project's venv).

    .venv-tinker/bin/python tests/tinker_client.py SCENARIO BASE_URL API_KEY MODEL [ARGS...]

prints one JSON object: what the scenario observed (logprobs, losses, errors by type and message).
Nothing here computes an expectation: the test compares against the project's own code.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import tinker
from tinker import types

# (input tokens, target tokens, weights): the tiny model's vocabulary is 28 words (tests/tiny_models.py)
DATA = [
    ([1, 4, 5, 7, 9], [4, 5, 7, 9, 2], [0.0, 1.0, 1.0, 1.0, 1.0]),
    ([1, 11, 17, 18], [11, 17, 18, 2], [0.0, 0.0, 1.0, 1.0]),
]


def datum(tokens, targets, **inputs) -> types.Datum:
    loss_inputs = {"target_tokens": np.asarray(targets, dtype=np.int64)}
    loss_inputs |= {k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=loss_inputs)


def sft_data() -> list[types.Datum]:
    return [datum(t, y, weights=w) for t, y, w in DATA]


def logprobs(out) -> list[list[float]]:
    return [o["logprobs"].to_numpy().astype(float).tolist() for o in out.loss_fn_outputs]


def error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "status": getattr(e, "status_code", None)}


def train(client, model: str) -> dict:
    """forward, then 3 x (forward_backward + optim_step) with cross_entropy, then forward again; then
    one importance_sampling step on the last forward's logprobs."""
    tc = client.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    first = tc.forward(sft_data(), "cross_entropy").result()
    losses = []
    for _ in range(3):
        fb = tc.forward_backward(sft_data(), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=0.05))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    after = tc.forward(sft_data(), "cross_entropy").result()
    behaviour = logprobs(after)
    is_data = [
        datum(t, y, logprobs=b, advantages=[1.0] * len(t))
        for (t, y, _), b in zip(DATA, behaviour, strict=True)
    ]
    is_out = tc.forward_backward(is_data, "importance_sampling").result()
    return {
        "first_logprobs": logprobs(first),
        "first_loss": first.metrics["loss:sum"],
        "train_losses": losses,
        "after_loss": after.metrics["loss:sum"],
        "after_logprobs": behaviour,
        "is_loss": is_out.metrics["loss:sum"],
        "is_logprobs": logprobs(is_out),
        "info": {"model_id": tc.get_info().model_id, "lora_rank": tc.get_info().lora_rank},
        "data": DATA,
    }


def refusals(client, model: str) -> dict:
    tc = client.create_lora_training_client(base_model=model, rank=2).result()
    seen = {}
    try:
        tc.forward_backward(sft_data(), "no_such_loss").result()
    except Exception as e:  # noqa: BLE001 - the scenario reports whatever the SDK raised
        seen["unknown_loss"] = error(e)
    try:
        client.create_lora_training_client(base_model="no-such-model", rank=2).result()
    except Exception as e:  # noqa: BLE001
        seen["unknown_model"] = error(e)
    return seen


def wrong_key(client, model: str) -> dict:
    try:
        client.create_lora_training_client(base_model=model, rank=2).result()
    except Exception as e:  # noqa: BLE001
        return {"error": error(e)}
    return {"error": None}


async def _tenants(client, model: str) -> dict:
    a, b = [await client.create_lora_training_client(base_model=model, rank=4, seed=0) for _ in range(2)]
    before = [logprobs(await tc.forward(sft_data(), "cross_entropy")) for tc in (a, b)]
    for _ in range(2):
        fb, opt = (
            a.forward_backward(sft_data(), "cross_entropy"),
            a.optim_step(types.AdamParams(learning_rate=0.05)),
        )
        await fb
        await opt
    after = [logprobs(await tc.forward(sft_data(), "cross_entropy")) for tc in (a, b)]
    return {"before": before, "after": after, "model_ids": [a.get_info().model_id, b.get_info().model_id]}


def tenants(client, model: str) -> dict:
    """Two tenants through the SDK's async interface (awaited futures): only the trained one moves."""
    return asyncio.run(_tenants(client, model))


def _draw(sc, prompt: list[int]) -> dict:
    params = types.SamplingParams(max_tokens=5, seed=11, temperature=1.0)
    r = sc.sample(types.ModelInput.from_ints(prompt), 3, params, include_prompt_logprobs=True).result()
    seqs = [
        {"tokens": list(map(int, q.tokens)), "logprobs": [float(x) for x in q.logprobs], "stop": q.stop_reason,
         "id": q.sequence_id}
        for q in r.sequences
    ]  # fmt: skip
    return {
        "sequences": seqs,
        "prompt_logprobs": [None if x is None else float(x) for x in r.prompt_logprobs],
    }


def sample(client, model: str) -> dict:
    """Train 2 steps, sample from save_weights_and_get_sampling_client, score the samples teacher-forced
    with the training client (same weights), then train once more, take a second snapshot (the same
    engine), sample it and score those samples too, and sample the old client again (its snapshot
    loaded back)."""
    tc = client.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    for _ in range(2):
        fb, opt = (
            tc.forward_backward(sft_data(), "cross_entropy"),
            tc.optim_step(types.AdamParams(learning_rate=0.05)),
        )
        fb.result()
        opt.result()
    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [1, 4, 5]
    first = _draw(sc, prompt)
    full = [prompt + q["tokens"] for q in first["sequences"]]
    scored = tc.forward([datum(f[:-1], f[1:]) for f in full], "cross_entropy").result()
    fb, opt = (
        tc.forward_backward(sft_data(), "cross_entropy"),
        tc.optim_step(types.AdamParams(learning_rate=0.05)),
    )
    fb.result()
    opt.result()
    second = _draw(tc.save_weights_and_get_sampling_client().result(), prompt)
    second_full = [prompt + q["tokens"] for q in second["sequences"]]
    scored_second = tc.forward([datum(f[:-1], f[1:]) for f in second_full], "cross_entropy").result()
    return {
        "prompt": prompt,
        "first": first,
        "teacher_forced": logprobs(scored),
        "second": second,
        "teacher_forced_second": logprobs(scored_second),
        "again": _draw(sc, prompt),
    }


def _step(tc) -> None:
    fb = tc.forward_backward(sft_data(), "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=0.05))
    fb.result()
    opt.result()


def checkpoints(client, model: str) -> dict:
    """Train 2 steps, save_state and a named sampler checkpoint; load the state into new clients with
    and without the optimizer (and onto an existing client); one more identical step on each; sample
    the sampler checkpoint and score its samples teacher-forced with the saved client."""
    tc = client.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    for _ in range(2):
        _step(tc)
    saved = tc.save_state("two-steps").result().path
    sampler = tc.save_weights_for_sampler("two-steps").result().path
    with_opt = client.create_training_client_from_state_with_optimizer(saved).result()
    without = client.create_training_client_from_state(saved).result()
    onto = client.create_lora_training_client(base_model=model, rank=4, seed=7).result()
    onto_before = logprobs(onto.forward(sft_data(), "cross_entropy").result())
    onto.load_state_with_optimizer(saved).result()
    clients = {"saved": tc, "with_opt": with_opt, "without": without, "onto": onto}
    loaded = {k: logprobs(c.forward(sft_data(), "cross_entropy").result()) for k, c in clients.items()}
    sc = client.create_sampling_client(model_path=sampler).result()
    prompt = [1, 4, 5]
    drawn = _draw(sc, prompt)
    full = [prompt + q["tokens"] for q in drawn["sequences"]]
    scored = tc.forward([datum(f[:-1], f[1:]) for f in full], "cross_entropy").result()
    for c in clients.values():
        _step(c)
    stepped = {k: logprobs(c.forward(sft_data(), "cross_entropy").result()) for k, c in clients.items()}
    seen = {}
    try:
        tc.save_state("two-steps").result()
    except Exception as e:  # noqa: BLE001 - the scenario reports whatever the SDK raised
        seen["exists"] = error(e)
    listed = client.create_rest_client().list_checkpoints(tc.get_info().model_id).result()
    return {
        "listed": [[c.checkpoint_id, c.checkpoint_type, c.tinker_path] for c in listed.checkpoints],
        "paths": {"weights": saved, "sampler": sampler},
        "onto_before": onto_before,
        "loaded": loaded,
        "stepped": stepped,
        "prompt": prompt,
        "drawn": drawn,
        "teacher_forced": logprobs(scored),
        "sampler_base_model": sc.get_base_model(),
        "errors": seen,
    }


def foreign(client, model: str, weights: str, sampler: str) -> dict:
    """Another API key tries the first key's checkpoints."""
    seen = {}
    try:
        client.create_training_client_from_state(weights).result()
    except Exception as e:  # noqa: BLE001
        seen["load"] = error(e)
    tc = client.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    try:
        tc.load_state(weights).result()
    except Exception as e:  # noqa: BLE001
        seen["load_onto"] = error(e)
    run = weights.split("/")[2]
    seen["listed"] = [
        c.tinker_path for c in client.create_rest_client().list_checkpoints(run).result().checkpoints
    ]
    try:
        client.create_sampling_client(model_path=sampler).sample(
            types.ModelInput.from_ints([1, 4]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    except Exception as e:  # noqa: BLE001
        seen["sample"] = error(e)
    return seen


def idle(client, model: str) -> dict:
    """A training client, its model id printed (`MODEL <id>`), then idle (the SDK's heartbeats running)
    until a line arrives on stdin; then a forward on it."""
    tc = client.create_lora_training_client(base_model=model, rank=2, seed=0).result()
    print(f"MODEL {tc.get_info().model_id}", flush=True)
    sys.stdin.readline()
    return {"logprobs": logprobs(tc.forward(sft_data(), "cross_entropy").result())}


SCENARIOS = {
    "idle": idle,
    "checkpoints": checkpoints,
    "foreign": foreign,
    "sample": sample,
    "train": train,
    "refusals": refusals,
    "wrong_key": wrong_key,
    "tenants": tenants,
}


def main() -> None:
    scenario, base_url, api_key, model, *extra = sys.argv[1:]
    client = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    out = SCENARIOS[scenario](client, model, *extra)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
