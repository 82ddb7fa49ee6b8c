"""The calculator demo as a black-box agent: what a user brings is this file alone.

The agent knows nothing of the trainer. It speaks to an OpenAI-compatible endpoint with the `openai`
client it is handed, offers the model one tool (`calculator`, defined and run here: the trainer never
sees it), runs the model's tool calls itself and sends back their results, and scores its own episode:
1 when the model's final answer is the product, else 0. The trainer records every call token for
token on its side (rollout_workers/gateway/) and trains on exactly what the model sampled.

    agent:
      function: demos/calculator_agent.py:agent     (configs/calculator_agent_tiny.yaml)
"""

import ast
import json
import operator
import re

MODEL = "policy"  # the name the run serves its policy under (agent.model_name)
MAX_TURNS = 3  # model calls per episode
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Integer arithmetic with + - * and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """The agent's own tool: + - * on integers, anything else an error."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not integer arithmetic: {expression!r}")

    if not re.fullmatch(r"[0-9+\-*() ]{1,40}", expression):
        raise ValueError(f"not integer arithmetic: {expression!r}")
    return str(value(ast.parse(expression, mode="eval").body))


def last_integer(text: str | None) -> str | None:
    found = re.findall(r"-?\d+", text or "")
    return found[-1] if found else None


async def agent(row: dict, client) -> float:
    """One episode: the row's messages, up to MAX_TURNS model calls, tool results sent back."""
    messages = list(row["messages"])
    for _ in range(MAX_TURNS):
        answer = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message = answer.choices[0].message
        if not message.tool_calls:  # the final answer
            return 1.0 if last_integer(message.content) == str(row["answer"]) else 0.0
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                result = calculator(json.loads(call.function.arguments)["expression"])
            except (ValueError, KeyError, TypeError, SyntaxError):
                result = "error"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0  # no answer within MAX_TURNS
