"""Building an environment by name: the built-in ones (the `tools` environment) are registered here,
next to the factory, and a user's module named by `rollout.environment.module` is imported first, so
that its `@register_environment` (`rollout_workers.environment`) runs."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

from rollout_workers.environment import Environment, environment_factory, register_environment
from rollout_workers.tools import ToolEnvironment

register_environment("tools")(ToolEnvironment)


def make_environment(
    name: str, module: str | None = None, kwargs: dict[str, Any] | None = None, source: str | None = None
) -> Environment:
    """The environment registered as `name`, built with `kwargs`, after importing `module`: a dotted
    name, or a .py file run from its text `source` (read from the file when None)."""
    if module:
        try:
            if module.endswith(".py"):
                _run_module_file(module, source)
            else:
                importlib.import_module(module)
        except Exception as e:
            raise ValueError(
                f"rollout.environment.module: cannot import {module!r} ({type(e).__name__}: {e}); give a .py "
                "file or a dotted module importable on the rollout workers"
            ) from e
    env = environment_factory(name)(**(kwargs or {}))
    if not isinstance(env, Environment):
        raise TypeError(f"environment {name!r} built a {type(env).__name__}, not an Environment")
    return env


_RUN_FILES: set[tuple[str, int]] = set()


def _run_module_file(path: str, source: str | None) -> None:
    """Run a user's environment file once per process (its decorators register what it defines)."""
    text = Path(path).read_text() if source is None else source
    key = (path, hash(text))
    if key in _RUN_FILES:
        return
    module = types.ModuleType(f"rayppo_environment_{len(_RUN_FILES)}")
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(compile(text, path, "exec"), module.__dict__)
    _RUN_FILES.add(key)
