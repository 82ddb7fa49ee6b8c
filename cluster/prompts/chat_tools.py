"""`data.tools`: the JSON schemas of the tools a chat template writes into the prompt.

An entry is `"path/to/file.py:function"` (a path from the current directory, imported once per file
like `reward.rule_module`) or `"dotted.module:function"`, naming a typed Python function with a
Google-style docstring whose schema transformers' `get_json_schema` writes, or a schema given as is
(`{type: function, function: {...}}`). The schemas are plain JSON: the rollout workers get them as
data and never import the user's function. Every problem is a ConfigError naming `data.tools`, the
entry and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cluster.config.schema import ConfigError
from reward_service.rules import import_user_module

HOW = (
    "get_json_schema needs a docstring, a type hint on every parameter and each parameter described "
    "under 'Args:', Google style"
)


def tool_schemas(entries: list[str | dict[str, Any]]) -> list[dict[str, Any]]:
    """The schema of each `data.tools` entry, in order; two tools of one name are an error."""
    schemas, seen = [], {}
    for i, entry in enumerate(entries):
        at = f"data.tools[{i}] {entry!r}" if isinstance(entry, str) else f"data.tools[{i}]"
        schema = _function_schema(entry, at) if isinstance(entry, str) else entry
        try:
            schema = json.loads(json.dumps(schema))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{at}: the schema is not plain JSON: {err}") from None
        name = schema["function"]["name"]
        if name in seen:
            raise ConfigError(f"{at}: a second tool named {name!r} (the first is data.tools[{seen[name]}])")
        seen[name] = i
        schemas.append(schema)
    return schemas


def _function_schema(entry: str, at: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    source, _, name = entry.rpartition(":")
    if source.endswith(".py") and not Path(source).expanduser().is_file():
        raise ConfigError(
            f"{at}: file {source!r} not found (a relative path is taken from the current directory, {Path.cwd()})"
        )
    try:
        module = import_user_module(str(Path(source).expanduser()) if source.endswith(".py") else source, at)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    function = getattr(module, name, None)
    if function is None:
        raise ConfigError(f"{at}: {source} has no function {name!r}")
    if not callable(function):
        raise ConfigError(f"{at}: {source}'s {name!r} is a {type(function).__name__}, not a function")
    try:
        return get_json_schema(function)
    except Exception as err:  # noqa: BLE001 - its own complaint (a missing hint or description) is the message
        raise ConfigError(f"{at}: get_json_schema cannot describe it: {err} ({HOW})") from None
