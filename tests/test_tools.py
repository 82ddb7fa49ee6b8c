"""The tool helpers and the built-in `tools` environment: the calculator's values and refusals, the
tool-call parser, and how a turn becomes a tool result or a scored final answer."""

from __future__ import annotations

import pytest

from rollout_workers.environment import Step, as_step, make_environment
from rollout_workers.tools import ToolError, calculator, last_integer, parse_tool_call

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
