"""Agents for the tests (tests/test_gateway_agents.py): each plays an episode with only the openai client."""

import asyncio
import json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


async def tool_agent(row, client):
    """Call the model; run its calculator calls; reward 1 when a call's result equals the row's answer."""
    messages = list(row["messages"])
    async with client:  # closing its client must not close the runner's pool: the other sessions use it
        for _ in range(2):
            answer = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                result = str(eval(json.loads(call.function.arguments)["expression"], {}))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                if result == row["answer"]:
                    return 1.0
    return 0.0


def sync_agent(row, client):
    with client:  # an agent that closes its client leaves the runner's shared pool open for the others
        answer = client.chat.completions.create(model="policy", messages=row["messages"], tools=TOOLS)
    return float(answer.choices[0].finish_reason == "tool_calls")


async def raising_agent(row, client):
    await client.chat.completions.create(model="policy", messages=row["messages"])
    raise RuntimeError("the agent's own bug")


async def hanging_agent(row, client):
    await client.chat.completions.create(model="policy", messages=row["messages"])
    await asyncio.sleep(3600)


async def wrong_return(row, client):
    await client.chat.completions.create(model="policy", messages=row["messages"])
    return "yes"


async def calls_then_waits(row, client):
    """One call, then a long wait: the runner is killed meanwhile (tests/test_gateway_agents.py)."""
    await client.chat.completions.create(model="policy", messages=row["messages"])
    await asyncio.sleep(3600)
