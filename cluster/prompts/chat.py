"""Chat prompts: a prompt given as a list of messages is checked, then rendered by a chat template.

A message is an object with a `role` (one of ROLES), a string `content` and, optionally, the keys of
OPTIONAL_KEYS (`tool_calls` a list of objects). A null optional key counts as absent: a columnar file
(parquet, a saved dataset) writes null where a message lacks a key that other messages of the column have.

Rendering is transformers' `apply_chat_template(messages, add_generation_prompt=True)`: the prompt's
text is its `tokenize=False` output and its ids its `tokenize=True` output, exactly as given; nothing is
added to them (no BOS: a template that wants one writes `{{ bos_token }}`; one that writes two is an
error). The template is the tokenizer's own (`data.chat_template: auto`) or a Jinja file's;
`data.system_prompt` goes first when the messages hold no system message; the template's extra
variables (`template_kwargs`) are `data.chat_template_kwargs` and, with `data.tools`, `tools=` the
tools' JSON schemas (cluster/prompts/chat_tools.py). The rollout workers render chat observations
with the same variables.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.config.schema import ConfigError, DataSection
from cluster.prompts.chat_tools import tool_schemas

ROLES = ("system", "user", "assistant", "tool")
OPTIONAL_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


def check_messages(value: list, where: str, column: str) -> list[dict[str, Any]]:
    """The messages of a prompt column, each a new dict without its null optional keys; a ConfigError
    naming the row, the column, the message and the allowed values otherwise."""
    at = f"{where}: field {column!r} (data.prompt_key)"
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ConfigError(
                f"{at}: message {i} is a {type(message).__name__}, not an object with role and content"
            )
        role = message.get("role")
        if role not in ROLES:
            raise ConfigError(f"{at}: message {i} has role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            got = (
                "no content"
                if message.get("content") is None
                else f"a {type(message['content']).__name__} content"
            )
            raise ConfigError(f"{at}: message {i} ({role}) has {got}; content must be a string")
        unknown = sorted(set(message) - {"role", "content", *OPTIONAL_KEYS})
        if unknown:
            raise ConfigError(
                f"{at}: message {i} has unknown key(s) {', '.join(unknown)}; allowed: role, content, "
                f"{', '.join(OPTIONAL_KEYS)}"
            )
        kept = {k: v for k, v in message.items() if v is not None}
        calls = kept.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise ConfigError(f"{at}: message {i} has tool_calls that are not a list of objects")
        messages.append(kept)
    return messages


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def json_messages(value: str, where: str, column: str) -> list[dict[str, Any]] | None:
    """A string prompt holding chat messages as text: JSON of a non-empty list of objects that each have a
    "role" is those messages, checked as a list column is (`check_messages`); the same list written as
    Python's repr (single quotes: `str()` of a list, pandas' `to_csv`) is a ConfigError naming the fix.
    Any other string is plain text: None."""
    text = value.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError:
        try:
            repr_messages = _is_messages(ast.literal_eval(text))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            repr_messages = False
        if repr_messages:
            raise ConfigError(
                f"{where}: field {column!r} (data.prompt_key) holds chat messages written as Python text "
                "(single quotes, as str() of a list or pandas' to_csv write them), not JSON: write the column "
                "as JSON text (json.dumps of each list) or as a list column (parquet, JSONL)"
            ) from None
        return None
    if not _is_messages(decoded):
        return None
    try:
        return check_messages(decoded, where, column)
    except ConfigError as err:
        raise ConfigError(f"{err} (the field is a string, read as JSON chat messages)") from None


@dataclass(frozen=True)
class ChatTemplate:
    """What renders chat prompts: a Jinja text (None: the tokenizer's own), the system prompt and the
    template's variables; `refusal` says why chat prompts are refused (then nothing is rendered)."""

    jinja: str | None
    source: str  # for messages: "the tokenizer's chat template", or the Jinja file
    system_prompt: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    refusal: str | None = None

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages rendered: the system prompt first when they hold no system message."""
        if self.system_prompt is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": self.system_prompt}, *messages]

    def render(self, tokenizer: Any, messages: list[dict[str, Any]], where: str) -> tuple[str, list[int]]:
        """(text, ids) of `messages` (a `conversation`) with the generation prompt, as
        apply_chat_template gives them."""
        if self.refusal:
            raise ConfigError(f"{where}: {self.refusal}")
        common = {"chat_template": self.jinja, "add_generation_prompt": True, **self.kwargs}
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **common)
            ids = list(
                tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **common)[
                    "input_ids"
                ]
            )
        except Exception as err:  # noqa: BLE001 - a template's own error (raise_exception, a bad key) is bad input
            raise ConfigError(
                f"{where}: {self.source} (data.chat_template) cannot render these messages: {type(err).__name__}: {err}"
            ) from None
        bos = tokenizer.bos_token_id
        if bos is not None and ids[:2] == [bos, bos]:
            raise ConfigError(
                f"{where}: {self.source} (data.chat_template) renders the BOS token twice: write "
                "{{ bos_token }} once in the template"
            )
        return text, ids


def template_kwargs(cfg: DataSection) -> dict[str, Any]:
    """The template's keyword arguments for every rendering with the prompts' template (prompts and
    chat observations): `data.chat_template_kwargs`, plus `tools` (the schemas of `data.tools`)."""
    kwargs = dict(cfg.chat_template_kwargs)
    if cfg.tools:
        kwargs["tools"] = tool_schemas(cfg.tools)
    return kwargs


def chat_template(cfg: DataSection, tokenizer: Any) -> ChatTemplate:
    """The template of `data.chat_template`: the tokenizer's ('auto'), a Jinja file's, or a refusal
    ('none', or 'auto' with a tokenizer that has no template), which only a chat prompt meets."""
    if cfg.chat_template == "none":
        return ChatTemplate(
            None,
            "no chat template (data.chat_template='none')",
            refusal="a list of chat messages, but data.chat_template='none' takes plain-text prompts only: "
            "set data.chat_template to 'auto' (the tokenizer's template) or a Jinja file",
        )
    extra = {"system_prompt": cfg.system_prompt, "kwargs": template_kwargs(cfg)}
    if cfg.chat_template == "auto":
        if not getattr(tokenizer, "chat_template", None):
            return ChatTemplate(
                None,
                "no chat template (the tokenizer has none)",
                refusal="a chat prompt, but the tokenizer (model.tokenizer_path) has no chat template and "
                "data.chat_template='auto': set data.chat_template to a Jinja file",
            )
        return ChatTemplate(None, "the tokenizer's chat template", **extra)
    path = Path(cfg.chat_template).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.chat_template: file not found: {cfg.chat_template} (or use 'auto' / 'none')")
    return ChatTemplate(path.read_text(encoding="utf-8"), f"the chat template {path}", **extra)
