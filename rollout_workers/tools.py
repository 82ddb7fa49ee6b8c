"""Tools for environments: a registry of text-in, text-out tools, tool-call parsers, and the built-in
`tools` environment (a model turn either calls a tool or answers; registered under that name in
`rollout_workers.environments`).

Two call formats (`call_format`, a registry of parsers):
- `tags`: `<open>argument</close>` with the tags the environment is configured with, e.g.
  `<calc>37*48</calc>`; the environment answers `<result>1776</result>`.
- `hermes`: the JSON tool calls that Qwen2.5's and Hermes' chat templates teach,
  `<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>`; `arguments` is an
  object of one string (a tool takes one text argument), and the answer is the result's bare text (with
  `rollout.environment.observation_format: chat` and role `tool` the template wraps it, e.g. in
  `<tool_response>`). Malformed JSON, an unknown tool or other arguments are a failed call.
A turn without a call is the final answer, checked against the prompt's `meta[answer_key]` (last
integer in the turn, exact match).
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from kernel.registry import Part, Registry
from rollout_workers.environment import Environment, Step

ToolFn = Callable[[str], str]
TOOLS: Registry[Part] = Registry("tool", "rollout.environment.kwargs.tools")  # filled by `@register_tool`


class ToolError(ValueError):
    """A tool refused its argument; the environment reports it to the model and counts it."""


def register_tool(name: str) -> Callable[[ToolFn], ToolFn]:
    return TOOLS.register(name)


def get_tool(name: str) -> ToolFn:
    return TOOLS.function(name)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_DIGITS = 30  # refuse results longer than this (a model can ask for 9**9**9)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if len(str(abs(value))) > MAX_DIGITS:
            raise ToolError("result too large")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ToolError(f"unsupported expression element {type(node).__name__}")


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Integer arithmetic with + - * and parentheses; anything else is a ToolError."""
    text = expression.strip()
    if not text or not re.fullmatch(r"[0-9+\-*() ]+", text):
        raise ToolError(f"not an integer expression: {expression!r}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"malformed expression: {expression!r}") from None
    return str(_evaluate(tree.body))


@dataclass(frozen=True)
class ToolCall:
    tool: str
    argument: str
    well_formed: bool  # False: an opening tag without its closing tag


def parse_tool_call(text: str, tags: dict[str, tuple[str, str]]) -> ToolCall | None:
    """The first tool call in `text` (tool name -> (open tag, close tag)), or None when there is none."""
    first: ToolCall | None = None
    at = len(text) + 1
    for tool, (open_tag, close_tag) in tags.items():
        i = text.find(open_tag)
        if i == -1 or i >= at:
            continue
        j = text.find(close_tag, i + len(open_tag))
        arg = text[i + len(open_tag) : j if j != -1 else len(text)]
        first, at = ToolCall(tool, arg, j != -1), i
    return first


HERMES_TAGS = ("<tool_call>", "</tool_call>")


def parse_hermes_call(text: str, tools: Collection[str]) -> ToolCall | None:
    """The first `<tool_call>{"name": ..., "arguments": {"<param>": "<text>"}}</tool_call>` in `text`, or
    None when there is none; a call that does not parse, names no known tool in `tools` or does not
    carry exactly one string argument is returned not well-formed (the environment answers an error)."""
    i = text.find(HERMES_TAGS[0])
    if i == -1:
        return None
    j = text.find(HERMES_TAGS[1], i)
    if j == -1:
        return ToolCall("", "", False)
    try:
        call = json.loads(text[i + len(HERMES_TAGS[0]) : j])
    except json.JSONDecodeError:
        return ToolCall("", "", False)
    name = call.get("name") if isinstance(call, dict) else None
    args = call.get("arguments") if isinstance(call, dict) else None
    if isinstance(args, str):  # some models write the arguments object as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    values = list(args.values()) if isinstance(args, dict) else []
    if name not in tools or len(values) != 1 or not isinstance(values[0], str):
        return ToolCall(str(name or ""), "", False)
    return ToolCall(name, values[0], True)


_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> str | None:
    found = _INTEGER.findall(text)
    return found[-1] if found else None


class ToolEnvironment(Environment):
    """Each model turn either calls a tool (answered with `<result>...</result>`, no reward) or gives the
    final answer (reward 1 when its last integer equals `meta[answer_key]`, else 0; the episode ends).

    `call_format` names the parser (`CALL_FORMATS`); `result_tags` default to `<result>`, `</result>` for
    `tags` and to none for `hermes`. Counters (`Step.info`): tool_calls, tool_errors (a malformed call
    or a tool that refused its argument: the model is told the result tags around `error_result`),
    answers."""

    def __init__(
        self,
        tools: dict[str, list[str]] | None = None,
        result_tags: tuple[str, str] | list[str] | None = None,
        answer_key: str = "answer",
        error_result: str = "error",
        call_format: str = "tags",
    ) -> None:
        if call_format not in CALL_FORMATS:
            raise ValueError(f"tools environment: call_format {call_format!r}; one of {sorted(CALL_FORMATS)}")
        tools = tools or {"calculator": ["<calc>", "</calc>"]}
        self.call_format = call_format
        self.tags = {name: (str(t[0]), str(t[1])) for name, t in tools.items()}
        self.tools = {name: get_tool(name) for name in self.tags}
        if result_tags is None:  # hermes: the bare result (the chat template marks the tool's answer)
            result_tags = ("<result>", "</result>") if call_format == "tags" else ("", "")
        self.result_open, self.result_close = result_tags
        self.answer_key = answer_key
        self.error_result = error_result  # what a failed call answers (in the policy tokenizer's alphabet)

    def reset(self, prompt: str, meta: dict[str, Any]) -> dict[str, Any]:
        if self.answer_key not in meta:
            raise KeyError(f"prompt meta has no {self.answer_key!r} (add it to data.meta_keys)")
        return {"answer": str(meta[self.answer_key]).strip()}

    def step(self, model_turn: str, state: dict[str, Any]) -> Step:
        call = CALL_FORMATS[self.call_format](model_turn, self)
        if call is None:
            right = last_integer(model_turn) == state["answer"]
            return Step("", 1.0 if right else 0.0, True, {"answers": 1.0})
        info = {"tool_calls": 1.0, "tool_errors": 0.0}
        try:
            if not call.well_formed:
                raise ToolError("unterminated tool call")
            result = self.tools[call.tool](call.argument)
        except ToolError:
            result, info["tool_errors"] = self.error_result, 1.0
        return Step(f"{self.result_open}{result}{self.result_close}", None, False, info)


# call_format -> parser of a model turn (the environment gives the parser what it knows: tags, tools)
CALL_FORMATS: dict[str, Callable[[str, ToolEnvironment], ToolCall | None]] = {
    "tags": lambda text, env: parse_tool_call(text, env.tags),
    "hermes": lambda text, env: parse_hermes_call(text, env.tools),
}
