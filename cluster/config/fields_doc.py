"""The configuration reference, generated from the schema: `python -m cluster.config.fields_doc`.

Every field of `RunConfig`, depth first in declaration order, as one Markdown table row: its dotted
path, its type (a `Literal`'s allowed values), its default and the description the schema gives it.
`docs/config-reference.md` is this command's output; `tests/test_config.py` fails when the two differ,
so a field added to the schema without regenerating the file is caught.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

HEADER = """# Configuration reference

Generated from the schema by `python -m cluster.config.fields_doc` (do not edit by hand: the tests
compare this file with the command's output). The overview is in [configuration.md](configuration.md).

| field | type | default | description |
|---|---|---|---|
"""


def _section(annotation) -> type[BaseModel] | None:
    """The model class a field holds (also inside `X | None`), or None for a leaf field."""
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    models = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    return models[0] if models else None


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def type_name(annotation) -> str:
    """A short readable type: Literal values quoted, unions joined by |, builtins by name."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " / ".join(json.dumps(a) for a in args)
    if _is_union(annotation):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return json.dumps(value, default=str)


def rows(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(path, type, default, description) of every field under `model`, sections expanded."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        section = _section(field.annotation)
        description = " ".join((field.description or "").split())
        if section is not None:
            yield path, type_name(field.annotation), default_text(field), description
            yield from rows(section, path + ".")
        else:
            yield path, type_name(field.annotation), default_text(field), description


def _cell(text: str) -> str:
    """Text inside a Markdown table cell: a literal | would end the cell."""
    return text.replace("|", "\\|")


def render() -> str:
    from cluster.config.schema import RunConfig

    lines = [HEADER.rstrip("\n")]
    for path, kind, default, description in rows(RunConfig):
        lines.append(f"| `{path}` | {_cell(kind)} | `{default}` | {_cell(description)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
