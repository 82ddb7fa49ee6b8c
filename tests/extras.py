"""Tests that need an optional package of the project (an extra: `vllm`)."""

from __future__ import annotations

import importlib.util

import pytest


def needs(extra: str) -> list[pytest.MarkDecorator]:
    """The marks of a test that needs `extra`: its marker (`make test-vllm` selects `-m vllm`), and a skip
    where the package does not import."""
    return [
        getattr(pytest.mark, extra),
        pytest.mark.skipif(
            importlib.util.find_spec(extra) is None,
            reason=f"{extra} is not importable here (make test-{extra} installs it)",
        ),
    ]
