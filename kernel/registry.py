"""One registry type for every part the project names in its config or lets users add.

A part has a name (what the config says), the object it stands for, and a one-line summary (what the
config reference and the allowed-values errors show). Parts the project ships name their object as a
`"module:attr"` string, imported on first use, so a registry (and the config that reads its names)
loads without torch, vLLM or a tracker's library. Parts defined in user code (an environment, a reward
rule, a tool) register the object itself with the `register(name)` decorator. A part described in a module of its own (a role) is listed by the
`"module:attr"` of the part itself, imported when the registry is first read: its module plus that one
line add it.

Every registry answers the same questions: `names()` (the config's allowed values, in registration
order), `reg[name]` (the entry, or a ValueError naming the config field and the allowed values),
`function(name)` (the object, imported when named by a string) and `describe()` (the config reference's
text). A part with parameters of its own declares their block (`section`: a strict model named by
`"module:Model"`), which the config that selects the part holds under the part's name (or the field
the part names, `section_field`), read only when the part is selected (and required then when
`section_required`). Registry-specific facts (an estimator's critic, an engine's devices) are fields
of a `Part` subclass, declared where the registry is.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    name: str
    function: str | Any  # "module:attr", imported on first use; or the object (registered by `register`)
    summary: str = ""  # one line: what it is (and its paper)
    # "module:Model" of the part's parameter block, a config section named after the part (or
    # `section_field`; its docstring is that field's description), read only when the part is selected;
    # None: the part takes no parameters
    section: str | None = None
    section_field: str | None = None  # the config field holding the block when not the part's name
    section_required: bool = False  # the block must be set when the part is selected (no defaults)

    @property
    def block_field(self) -> str | None:
        """The config field that holds the part's block (`section_field`, else its name); None: no block."""
        if self.section is None:
            return None
        return self.section_field or self.name


P = TypeVar("P", bound=Part)


class Registry(Generic[P]):
    """Parts of one kind, in registration order. `kind` names them in errors ("rollout engine");
    `field` is the config field that takes their names ("rollout.engine")."""

    def __init__(self, kind: str, field: str, parts: Iterable[P | str] = ()) -> None:
        """`parts`: the parts, or the `"module:attr"` of a part described in a module of its own; a
        registry listing one reads its parts (imports those modules) when it is first read."""
        self.kind, self.field = kind, field
        self._parts: dict[str, P] = {}
        listed = list(parts)
        self._listed: list[P | str] = listed if any(isinstance(p, str) for p in listed) else []
        for part in () if self._listed else listed:
            self.add(part)  # type: ignore[arg-type]

    def _load(self) -> dict[str, P]:
        """The parts by name, those listed by `"module:attr"` imported on the first read, in listed order."""
        if self._listed:
            listed, self._listed = self._listed, []
            for part in listed:
                self.add(resolve(part) if isinstance(part, str) else part)
        return self._parts

    def add(self, part: P) -> P:
        if not isinstance(part, Part):
            raise TypeError(f"{self.kind}: {part!r} is no registry part")
        if part.name in self._load():
            raise ValueError(f"{self.kind} {part.name!r} is registered twice")
        self._parts[part.name] = part
        return part

    def register(self, name: str, summary: str = "") -> Callable[[Any], Any]:
        """Decorator registering the decorated object itself under `name` (a part defined in user code).
        The same definition registered again (its module run a second time, also under another module
        name) replaces the first; another definition under `name` is an error naming the first."""

        def wrap(obj: Any) -> Any:
            old = self._load().get(name)
            if old is not None and _origin(old.function) != _origin(obj):
                held = old.function
                raise ValueError(
                    f"{self.kind} {name!r} is already registered by {held.__module__}.{held.__qualname__}"
                )
            self._parts[name] = Part(name=name, function=obj, summary=summary)  # type: ignore[assignment]
            return obj

        return wrap

    def names(self) -> tuple[str, ...]:
        return tuple(self._load())

    def __contains__(self, name: object) -> bool:
        return name in self._load()

    def __getitem__(self, name: str) -> P:
        parts = self._load()
        try:
            return parts[name]
        except KeyError:
            allowed = ", ".join(parts) or "none registered"
            raise ValueError(f"unknown {self.kind} {name!r} ({self.field}); allowed: {allowed}") from None

    def __iter__(self) -> Iterator[P]:
        return iter(self._load().values())

    def __len__(self) -> int:
        return len(self._load())

    def function(self, name: str) -> Any:
        """The part's object, imported on first use when named by a string."""
        target = self[name].function
        return resolve(target) if isinstance(target, str) else target

    def describe(self) -> str:
        """The allowed values with their one-line summaries (the config reference's text)."""
        return "; ".join(f"'{p.name}': {p.summary}" if p.summary else f"'{p.name}'" for p in self)


@functools.cache
def resolve(target: str) -> Any:
    """The object a `module:attr` string names, imported on first use."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _origin(obj: Any) -> tuple[str, str]:
    """Where `obj` is defined: its module's file (else the module's name), and its qualified name."""
    module = getattr(obj, "__module__", "")
    file = getattr(sys.modules.get(module), "__file__", None)
    return (str(Path(file).resolve()) if file else module, getattr(obj, "__qualname__", repr(obj)))
