"""The calculator task as an OpenAI Agents SDK agent (tests/test_agent_run.py): a `function_tool`, a
chat-completions model over the client the runner hands it, the SDK's own tool loop."""

import re

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

set_tracing_disabled(True)  # no export to OpenAI's tracing service (nothing outside can be reached)


@function_tool
def calculator(expression: str) -> str:
    """Integer arithmetic with + - * and parentheses."""
    if not re.fullmatch(r"[0-9+\-*() ]{1,40}", expression):
        raise ValueError("not integer arithmetic")
    return str(eval(expression, {"__builtins__": {}}))


async def agent(row, client):
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
    solver = Agent(name="calculator", tools=[calculator], model=model)
    try:
        result = await Runner.run(solver, row["messages"][0]["content"], max_turns=3)
    except MaxTurnsExceeded:
        return 0.0
    found = re.findall(r"-?\d+", str(result.final_output or ""))
    return 1.0 if found and found[-1] == str(row["answer"]) else 0.0
