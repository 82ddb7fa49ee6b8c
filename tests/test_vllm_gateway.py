"""The agent gateway in front of the vLLM engine (`make test-vllm`): the same OpenAI clients, the same
capture. The scripted policy's tool calls round-trip, the session is one sample equal to the template's
rendering with only sampled tokens in the loss, and concurrent sessions share engine calls."""

from __future__ import annotations

import asyncio

import openai
import pytest
from extras import needs
from scripted_models import scripted_policy
from test_gateway import Served, render, tool_loop

pytestmark = needs("vllm")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # a wide batch window (cap 4 s): a round of open sessions is batched by construction, not by timing
    served = Served(*scripted_policy(tmp_path_factory.mktemp("scripted")), engine="vllm", batch_window_ms=500)
    yield served
    served.worker._gateway.close()


def test_a_tool_loop_through_vllm_is_one_sample_of_what_it_sampled(served):
    session = served.open()
    messages, answers = tool_loop(served.client(session))
    assert answers[0].choices[0].finish_reason == "tool_calls"
    served.end(session, reward=1.0)
    (sample,) = served.worker.take_sessions([session["session_id"]])
    turn = int(sample.episode.turn_ends[0]) + 1
    whole = render(served.tok, [messages[0], {**messages[1], "tool_calls": [
        {"function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]}, messages[2]])  # fmt: skip
    assert list(sample.prompt_ids) + list(sample.response_ids[: len(whole) - len(sample.prompt_ids)]) == whole
    mask = list(sample.episode.loss_mask)
    assert mask[:turn] == [1] * turn and mask[-turn:] == [1] * turn and not any(mask[turn:-turn])


def test_concurrent_sessions_share_vllm_engine_calls(served):
    before = served.worker._gateway.gateway.stats()
    sessions = [served.open(prompt_index=k) for k in range(8)]  # all open before any call: 8 expected

    async def one(session: dict) -> None:
        async with openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"]) as client:
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1*2="}])

    async def many() -> None:
        await asyncio.gather(*(one(s) for s in sessions))

    asyncio.run(many())
    for session in sessions:
        served.end(session)
    after = served.worker._gateway.gateway.stats()
    assert after["calls"] - before["calls"] == 8 and after["batches"] - before["batches"] < 8
