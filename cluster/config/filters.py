"""`data.dynamic_sampling.filter`'s allowed values: the built-in group filters, a registry of the one type
(`kernel.registry`) naming their factories (`cluster.pipeline.dynamic_sampling`, imported when the run
starts, not by the config), or a user function's path."""

from __future__ import annotations

import re

from kernel.registry import Part, Registry

# Each built-in filter's `function` is a factory `(std_eps) -> GroupFilter | None` (None: every group kept).
FILTERS: Registry[Part] = Registry(
    "group filter",
    "data.dynamic_sampling.filter",
    [
        Part(
            name="none",
            function="cluster.pipeline.dynamic_sampling:no_filter",
            summary="all groups are trained (dynamic sampling off)",
        ),
        Part(
            name="nonzero_std",
            function="cluster.pipeline.dynamic_sampling:nonzero_std",
            summary="only groups whose rewards' std exceeds std_eps (DAPO's dynamic sampling)",
        ),
    ],
)
ALLOWED = (
    f"{', '.join(map(repr, FILTERS.names()))}, or 'package.module:function' / 'path/to/file.py:function'"
)
_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_IDENT = re.compile(r"^[A-Za-z_]\w*$")


def check_filter_spec(spec: str) -> str:
    """`spec` if it names a built-in filter or has the shape of a user function's path, else ValueError
    naming the allowed values (the config's validator; the function is imported at start-up)."""
    if spec in FILTERS:
        return spec
    module, sep, func = spec.rpartition(":")
    if sep and _IDENT.match(func) and (module.endswith(".py") or _DOTTED.match(module)):
        return spec
    raise ValueError(f"unknown filter {spec!r}; allowed: {ALLOWED}")
