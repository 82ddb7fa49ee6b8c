"""The one place `cluster/` reaches the embedded demos (`demos/`, a room above it): the names a config
may give in `model.demo_assets.demo`, and building a demo's assets before a run when they are missing
or out of date. Everything else in `cluster/` knows nothing of the demos (checked by tests/test_layout.py)."""

from __future__ import annotations


class DemoAssetsError(RuntimeError):
    """A demo's assets could not be built (or the build missed its quality band); the message says why."""


def known_demos() -> list[str]:
    from demos import DEMOS

    return sorted(DEMOS)


def build_demo_assets(demo: str, folder: str) -> None:
    """Build `demo`'s assets into `folder` unless they are there and current (`demos.ensure_demo`)."""
    from demos import DemoBuildError, ensure_demo

    try:
        ensure_demo(demo, folder)
    except DemoBuildError as err:
        raise DemoAssetsError(str(err)) from None
