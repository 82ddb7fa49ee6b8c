"""The tool helpers and the built-in `tools` environment: the calculator's values and refusals, the
tool-call parser, and how a turn becomes a tool result or a scored final answer."""

from __future__ import annotations

import pytest

from rollout_workers.environment import Step, as_step
from rollout_workers.environments import make_environment
from rollout_workers.tools import ToolCall, ToolError, calculator, last_integer, parse_tool_call

TAGS = {"calculator": ("<calc>", "</calc>")}


@pytest.mark.parametrize(
    "expr,value", [("37*48", "1776"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("10-25", "-15"), (" 7 ", "7")]
)
def test_calculator_values(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize(
    "expr", ["", "2**10", "__import__('os')", "1/2", "3*", "9" * 40 + "*" + "9" * 40, "a+b"]
)
def test_calculator_refuses_anything_else(expr):
    with pytest.raises(ToolError):
        calculator(expr)


def test_parse_tool_call():
    assert parse_tool_call("<calc>37*48</calc>", TAGS).argument == "37*48"
    call = parse_tool_call("x<calc>37*4", TAGS)
    assert call.tool == "calculator" and not call.well_formed and call.argument == "37*4"
    assert parse_tool_call("1776", TAGS) is None
    both = {"calculator": ("<calc>", "</calc>"), "search": ("<q>", "</q>")}
    assert parse_tool_call("<q>a</q><calc>1</calc>", both).tool == "search"  # the first call in the text
    assert last_integer("it is 12 or 1776") == "1776" and last_integer("none") is None


def test_tools_environment_turns():
    env = make_environment("tools")
    state = env.reset("37*48=", {"answer": "1776"})
    assert as_step(env.step("<calc>37*48</calc>", state)) == Step(
        "<result>1776</result>", None, False, {"tool_calls": 1.0, "tool_errors": 0.0}
    )
    bad = as_step(env.step("<calc>37*", state))
    assert bad.observation == "<result>error</result>" and bad.info["tool_errors"] == 1.0
    assert as_step(env.step("1776", state)) == Step("", 1.0, True, {"answers": 1.0})
    assert as_step(env.step("1777", state)).reward == 0.0
    with pytest.raises(KeyError, match="answer"):
        env.reset("37*48=", {})
    with pytest.raises(ValueError, match="unknown environment"):
        make_environment("no-such-env")
    with pytest.raises(TypeError, match="observation"):
        as_step((None, 1.0, True))


def test_hermes_json_tool_calls():
    """Qwen2.5 / Hermes tool calls: `<tool_call>{"name", "arguments"}</tool_call>`, answered with the bare
    result; every malformed form is a counted tool error, never an answer."""
    from rollout_workers.tools import parse_hermes_call

    tools = {"calculator"}
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'
    assert parse_hermes_call("let me compute " + call, tools) == ToolCall("calculator", "37*48", True)
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2+3\\"}"}</tool_call>'
    assert parse_hermes_call(as_string, tools).argument == "2+3"
    assert parse_hermes_call("1776", tools) is None
    for bad in (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}',  # unterminated
        "<tool_call>{name: calculator}</tool_call>",  # not JSON
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',  # unknown tool
        '<tool_call>{"name": "calculator", "arguments": {"a": "1", "b": "2"}}</tool_call>',  # two arguments
        '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>',  # not a string
        "<tool_call>[1, 2]</tool_call>",
    ):
        assert not parse_hermes_call(bad, tools).well_formed, bad

    env = make_environment("tools", kwargs={"call_format": "hermes"})
    state = env.reset("37*48=", {"answer": "1776"})
    assert as_step(env.step(call, state)) == Step(
        "1776", None, False, {"tool_calls": 1.0, "tool_errors": 0.0}
    )
    bad = as_step(env.step("<tool_call>{oops}</tool_call>", state))
    assert bad.observation == "error" and bad.info["tool_errors"] == 1.0 and not bad.done
    assert as_step(env.step("the answer is 1776", state)) == Step("", 1.0, True, {"answers": 1.0})
    with pytest.raises(ValueError, match=r"call_format 'xml'; one of \['hermes', 'tags'\]"):
        make_environment("tools", kwargs={"call_format": "xml"})
