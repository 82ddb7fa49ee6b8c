"""A completion's text as OpenAI's assistant message: its content and its `tool_calls`.

The policy writes tool calls in a call format the project knows (`rollout_workers.tools`); the gateway
parses them out of the sampled text and answers them as OpenAI `tool_calls` (arguments as a JSON
string), and the text outside the calls as `content` (None when empty). A call that does not parse,
or names a tool the request did not offer, is not a call: the text stays the message's content, as the
model wrote it, and the call is counted as malformed. With `tool_choice='none'` nothing is parsed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass

from rollout_workers.tools import HERMES_TAGS


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: tuple[ParsedCall, ...]
    malformed: int  # call blocks that did not parse or named no offered tool


def parse_hermes(text: str, tools: Collection[str]) -> Parsed:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text` (Qwen2.5's and Hermes'
    format); when any block is malformed, none is a call."""
    open_tag, close_tag = HERMES_TAGS
    calls, rest, at, malformed = [], [], 0, 0
    while (i := text.find(open_tag, at)) != -1:
        j = text.find(close_tag, i)
        rest.append(text[at:i])
        end = len(text) if j == -1 else j + len(close_tag)
        call = _hermes_call(text[i + len(open_tag) : j] if j != -1 else "", tools)
        if call is None:
            malformed += 1
        else:
            calls.append(call)
        at = end
    rest.append(text[at:])
    if malformed or not calls:
        return Parsed(text or None, (), malformed)
    content = "".join(rest).strip()
    return Parsed(content or None, tuple(calls), 0)


def _hermes_call(body: str, tools: Collection[str]) -> ParsedCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ParsedCall(call["name"], arguments) if isinstance(arguments, dict) else None


# rollout.gateway.call_format -> the parser of a completion's text (given the offered tools' names)
CALL_FORMATS: dict[str, Callable[[str, Collection[str]], Parsed]] = {"hermes": parse_hermes}
