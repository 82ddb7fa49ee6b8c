"""The agent gateway against the real `openai` SDK (sync and async clients) on 127.0.0.1, in front of
a real rollout worker (hf engine) holding tiny GPT-2 policies on the calculator demo's ChatML tokenizer.

What is checked: tool calls round-trip as OpenAI tool_calls; a session whose calls extend each other is
one sample equal, token for token, to the template's rendering of the whole conversation, with exactly
the tokens the policy sampled in the loss; captured logprobs are the engine's (and its teacher-forced
logprobs at the run's temperature); streamed and unstreamed answers agree; concurrent sessions are
batched into fewer engine calls; history breaks split or are refused, and are counted; a weight load
between two calls tags each token with its version; bad requests get OpenAI errors naming the field.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest
from scripted_models import random_policy, scripted_policy

from rollout_workers.config import GatewayConfig, RolloutConfig, SamplingConfig
from rollout_workers.worker import RolloutWorker

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "integer arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


class Served:
    """A worker with its gateway, and helpers to open, reward and end sessions over HTTP."""

    def __init__(self, path: str, tok, engine: str = "hf", **gateway) -> None:
        config = RolloutConfig(
            engine=engine, sampling=SamplingConfig(max_new_tokens=20), gateway=GatewayConfig(**gateway)
        )
        self.worker = RolloutWorker(path, config)
        self.tok = tok
        info = self.worker.start_gateway("tiny")
        self.url, self.admin = info["url"], info["admin_key"]

    def post(self, route: str, key: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + route, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)

    def open(self, **body) -> dict:
        answer = self.post("/sessions", self.admin, body)
        answer.raise_for_status()
        return answer.json()

    def end(self, session: dict, reward: float | None = None, status: str = "done") -> dict:
        if reward is not None:
            self.post(f"/sessions/{session['session_id']}/reward", session["api_key"], {"reward": reward})
        return self.post(
            f"/sessions/{session['session_id']}/end", session["api_key"], {"status": status}
        ).json()

    def client(self, session: dict) -> openai.OpenAI:
        return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    served = Served(*scripted_policy(tmp_path_factory.mktemp("scripted")))
    yield served
    served.worker._gateway.close()


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    served = Served(*random_policy(tmp_path_factory.mktemp("random")))
    yield served
    served.worker._gateway.close()


def render(tok, messages, **kwargs) -> list[int]:
    return list(
        tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
        )["input_ids"]
    )


def tool_loop(client: openai.OpenAI, rounds: int = 2) -> tuple[list[dict], list]:
    messages: list[dict] = [{"role": "user", "content": "12*34="}]
    answers = []
    for _ in range(rounds):
        answer = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        answers.append(answer)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            result = str(eval(json.loads(call.function.arguments)["expression"]))  # the agent's own tool
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages, answers


def test_tool_calls_round_trip_and_a_session_is_one_sample_equal_to_the_rendered_conversation(scripted):
    session = scripted.open(prompt_index=7, sample_index=2)
    messages, answers = tool_loop(scripted.client(session))
    first = answers[0].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12*34"}
    facts = scripted.end(session, reward=1.0)
    assert facts["status"] == "done" and facts["segments"] == 1 and facts["calls"] == 2
    (sample,) = scripted.worker.take_sessions([session["session_id"]])
    assert (sample.prompt_index, sample.sample_index) == (7, 2)
    tok = scripted.tok
    # the template renders the agent's conversation (arguments as objects) to exactly the captured ids
    as_template = [
        {**m, "tool_calls": [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]}
        if m.get("tool_calls") else m
        for m in messages[:3]  # user, the first answer, the tool's result: what the second call saw
    ]  # fmt: skip
    whole = render(tok, as_template)
    assert list(sample.prompt_ids) == render(tok, messages[:1])
    last_turn = list(sample.response_ids[len(whole) - len(sample.prompt_ids) :])
    assert list(sample.prompt_ids) + list(sample.response_ids) == whole + last_turn
    # loss on the two completions only; the glue (end-of-turn newline, the tool message, the next
    # generation prompt) is masked
    turn = len(answers[0].choices[0].message.tool_calls and tok.encode(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call><|im_end|>', add_special_tokens=False))  # fmt: skip
    glue = len(sample.response_ids) - 2 * turn
    assert list(sample.episode.loss_mask) == [1] * turn + [0] * glue + [1] * turn
    assert list(sample.episode.turn_ends) == [turn - 1, len(sample.response_ids) - 1]
    assert sample.episode.outcome == 1.0 and np.isnan(sample.episode.turn_rewards[0])
    assert sample.episode.status == "done" and sample.finish_reason == "stop"
    np.testing.assert_allclose(sample.logprobs, 0.0, atol=1e-4)  # the script is certain


def test_captured_logprobs_are_the_engines_and_the_policys_own(sampled):
    session = sampled.open()
    answer = sampled.client(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "12*34="}], logprobs=True, seed=3
    )
    sampled.end(session, reward=0.0)
    (sample,) = sampled.worker.take_sessions([session["session_id"]])
    shown = [t.logprob for t in answer.choices[0].logprobs.content]
    np.testing.assert_allclose(shown, sample.logprobs, rtol=0, atol=1e-6)
    # teacher-forced logprobs of the captured sequence at the run's temperature (1.0) are the same
    sequence = np.concatenate([sample.prompt_ids, sample.response_ids])
    (forced,) = sampled.worker._engine.probe_logprobs([sequence])
    np.testing.assert_allclose(forced[len(sample.prompt_ids) - 1 :], sample.logprobs, atol=1e-4)
    assert sample.episode.loss_mask.all() and sample.policy_version == 0 and sample.token_versions is None


def test_streamed_and_unstreamed_answers_agree(sampled):
    session = sampled.open()
    client = sampled.client(session)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "37*48="}], "seed": 11}
    whole = client.chat.completions.create(**ask)
    # a fresh conversation in the same session: a new segment, counted as a history break
    pieces, finish = [], None
    for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    facts = sampled.end(session)
    assert facts["segments"] == 2 and facts["history_breaks_history"] == 1
    first, second = sampled.worker.take_sessions([session["session_id"]])
    assert list(first.response_ids) == list(second.response_ids)


def test_concurrent_sessions_of_the_async_client_are_batched(tmp_path):
    """Every session is open before any calls (so the batcher expects 8), and its window is wide (cap
    4 s): the round is batched by construction, not by how fast this machine sends the calls."""
    served = Served(*random_policy(tmp_path), batch_window_ms=500)
    sessions = [served.open(prompt_index=k) for k in range(8)]

    async def one(k: int, session: dict) -> None:
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"{k}*2="}])
        await client.close()

    async def many() -> None:
        await asyncio.gather(*(one(k, s) for k, s in enumerate(sessions)))

    try:
        asyncio.run(many())
        for k, session in enumerate(sessions):
            served.end(session, reward=float(k))
        stats = served.worker._gateway.gateway.stats()
        assert stats["calls"] == 8
        assert stats["batches"] < 8  # at least two calls shared an engine call
        samples = served.worker.take_sessions([s["session_id"] for s in sessions])
        assert sorted(s.prompt_index for s in samples) == list(range(8))
        assert all(s.episode.outcome == s.prompt_index for s in samples)
    finally:
        served.worker._gateway.close()


def test_a_dropped_history_splits_or_is_refused_as_configured(scripted, tmp_path):
    session = scripted.open()
    client = scripted.client(session)
    messages, _ = tool_loop(client, rounds=1)
    summary = [{"role": "user", "content": "12*34= (summarised)"}, messages[-1]]  # history rewritten
    client.chat.completions.create(model="tiny", messages=summary, tools=TOOLS)
    facts = scripted.end(session, reward=1.0)
    assert facts["segments"] == 2 and facts["history_breaks_history"] == 1
    samples = scripted.worker.take_sessions([session["session_id"]])
    assert [s.episode.outcome for s in samples] == [1.0, 1.0]  # both share the session's reward

    refusing = Served(*scripted_policy(tmp_path), on_history_break="refuse")
    try:
        session = refusing.open()
        client = refusing.client(session)
        tool_loop(client, rounds=1)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=summary, tools=TOOLS)
        assert refused.value.code == "history_rewritten" and refused.value.param == "messages"
        assert refusing.end(session)["history_breaks_history"] == 1
    finally:
        refusing.worker._gateway.close()


def test_a_template_that_rewrites_history_splits_every_call():
    """Qwen3's real template drops past reasoning: the gateway cannot grow a session token-wise, says why,
    and a call after the first starts a new sample rendered in full (counted as a template break)."""
    from chat_tokenizers import QWEN3_SPECIALS, QWEN3_TEMPLATE, chat_tokenizer

    from rollout_workers.gateway.gateway import Gateway
    from rollout_workers.gateway.sessions import Choice

    words = ["hello hi again be brief hmm <think> </think> observation what is two"]
    tok = chat_tokenizer(words, QWEN3_SPECIALS, QWEN3_TEMPLATE, eos="<|im_end|>")
    eos = frozenset({tok.convert_tokens_to_ids("<|im_end|>")})
    gateway = Gateway(tok, "tiny", SamplingConfig(), GatewayConfig(), lambda *a: None, eos, None)
    try:
        assert "does not preserve the prefix" in (gateway.template_refusal or "")
        session = gateway.open_session()
        first = [{"role": "user", "content": "hello"}]
        prepared = session.prepare(first, None)
        answer = {"role": "assistant", "content": "<think> hmm </think> hi"}
        ids = tok.encode("<think> hmm </think> hi", add_special_tokens=False) + sorted(eos)
        session.record(prepared, [Choice("c-0", ids, [0.0] * len(ids), [0] * len(ids), True, answer)])
        second = session.prepare([*first, answer, {"role": "user", "content": "again"}], None)
        assert second.extends is None and session.counts["history_breaks_template"] == 1
        assert second.prompt == render(tok, [*first, answer, {"role": "user", "content": "again"}])
    finally:
        gateway.close()


def test_a_weight_load_between_two_calls_tags_each_token_with_its_version(scripted):
    session = scripted.open()
    client = scripted.client(session)
    messages = [{"role": "user", "content": "12*34="}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS).choices[0].message
    state = {k: v.clone() for k, v in scripted.worker._engine.model.state_dict().items()}
    scripted.worker.load_weights(state, version=scripted.worker.version() + 1, probe=False)
    messages += [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "408"},
    ]
    client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    scripted.end(session, reward=1.0)
    (sample,) = scripted.worker.take_sessions([session["session_id"]])
    held = scripted.worker.version()
    versions = sample.versions()
    first_turn = int(sample.episode.turn_ends[0]) + 1
    assert set(versions[:first_turn]) == {held - 1} and versions[-1] == held
    assert sample.policy_version == held - 1  # a sample's version is its oldest token's


def test_bad_requests_get_openai_errors_naming_the_field(scripted):
    session = scripted.open()
    client = scripted.client(session)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "1*2="}]}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=session["base_url"], api_key="not-a-session", max_retries=0
        ).chat.completions.create(**ask)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**ask, temperature=0.5)
    assert error.value.param == "temperature" and "1.0" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**ask, max_tokens=500)
    assert error.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**ask, stop=["12"])  # two tokens of this tokenizer
    assert error.value.param == "stop"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**ask, extra_body={"beam_width": 4})
    assert error.value.param == "beam_width"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "narrator", "content": "x"}])
    assert error.value.param.startswith("messages.0")
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(**{**ask, "model": "gpt-4o"})
    assert "tiny" in error.value.message
    assert [m.id for m in client.models.list()] == ["tiny"]
    scripted.end(session)
    with pytest.raises(openai.NotFoundError):  # an ended session takes no more calls
        client.chat.completions.create(**ask)
    assert scripted.post("/sessions", "wrong", {}).status_code == 401


def test_sessions_past_the_limit_get_429_with_retry_after(tmp_path):
    served = Served(*scripted_policy(tmp_path), max_sessions=1)
    try:
        served.open()
        answer = served.post("/sessions", served.admin, {})
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "too_many_sessions"
    finally:
        served.worker._gateway.close()


def test_the_completions_endpoint_extends_a_session_by_token_ids(scripted):
    session = scripted.open()
    client = scripted.client(session)
    prompt = render(scripted.tok, [{"role": "user", "content": "12*34="}])
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=20)
    sampled = scripted.tok.encode(first.choices[0].text, add_special_tokens=False) + [
        scripted.tok.eos_token_id
    ]
    follow = (
        prompt
        + sampled
        + scripted.tok.encode(
            "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
    )
    client.completions.create(model="tiny", prompt=follow, max_tokens=20)
    facts = scripted.end(session, reward=1.0)
    assert facts["segments"] == 1
    (sample,) = scripted.worker.take_sessions([session["session_id"]])
    glue = len(follow) - len(prompt) - len(sampled)
    assert list(sample.episode.loss_mask) == [1] * len(sampled) + [0] * glue + [1] * len(sampled)


def test_streamed_tool_calls_agree_with_the_unstreamed_answer(scripted):
    session = scripted.open()
    client = scripted.client(session)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "12*34="}], "tools": TOOLS}
    whole = client.chat.completions.create(**ask).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]
    scripted.end(session)


def _until(condition, within_s: float = 60.0) -> None:
    """Wait for a record the gateway itself keeps to say so."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "the gateway never recorded it"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_before_its_answer_fails_its_session(scripted, stream):
    """The engine is held (as a weight load holds it) while the client gives up and closes its connection;
    the gateway notices the disconnect as it happens, records the call once the engine answers, and ends
    the session failed: its sample is a failed episode, dropped downstream unless `train_failed`."""
    session = scripted.open()
    impatient = openai.OpenAI(
        base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=3.0
    )
    live = scripted.worker._gateway.gateway.sessions[session["session_id"]]
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "12*34="}], "tools": TOOLS}
    with scripted.worker._gate.hold(load=True):
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(**ask, stream=stream)
        _until(lambda: live.counts["disconnects"] == 1)  # seen while the call waits for the engine
        assert live.ended is None
    _until(lambda: live.ended is not None)
    assert (live.ended, live.counts["calls"], live.counts["disconnects"]) == ("failed", 1, 1)
    with pytest.raises(openai.NotFoundError):  # an ended session takes no more calls
        scripted.client(session).chat.completions.create(**ask)
    (sample,) = scripted.worker.take_sessions([session["session_id"]])
    assert sample.episode.status == "env_error" and "disconnected" in sample.episode.error
    assert len(sample.response_ids) > 0  # the engine's tokens were recorded before the session failed
