"""`data.dynamic_sampling.filter`'s allowed values, checked by the config without importing the filters
(`cluster.pipeline.dynamic_sampling` resolves them when the run starts)."""

from __future__ import annotations

import re

BUILTIN_FILTERS = ("none", "nonzero_std")
ALLOWED = "'none', 'nonzero_std', or 'package.module:function' / 'path/to/file.py:function'"
_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")


def check_filter_spec(spec: str) -> str:
    """`spec` if it names a built-in filter or has the shape of a user function's path, else ValueError
    naming the allowed values (the config's validator; the function is imported at start-up)."""
    if spec in BUILTIN_FILTERS:
        return spec
    module, sep, func = spec.rpartition(":")
    if sep and _IDENT.match(func) and (module.endswith(".py") or _DOTTED.match(module)):
        return spec
    raise ValueError(f"unknown filter {spec!r}; allowed: {ALLOWED}")
