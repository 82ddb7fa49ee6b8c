"""How long the driver waits: every loop of the driver that waits on the cluster holds a `Deadline`
from the config and ends, past it, in a `WaitTimeout` that names what it waited for and the setting
that bounds it. Nothing of the driver polls without one (tests/test_deadlines.py reads every loop).

A deadline either runs from its start (a learner step, an export, a start-up), or, for a loop that
makes progress in events (the stream's step: calls finishing, batches taken), from the last event:
`renew` when something moved, `check` when nothing did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


class WaitTimeout(TimeoutError):
    """A driver wait loop ran past its deadline; the message names what it waited for and the
    config field that bounds it."""


@dataclass
class Deadline:
    """`what` the loop waits for (as the error says it), `setting` the config field its `seconds` come
    from (e.g. 'timeouts.generate_s')."""

    what: str
    setting: str
    seconds: float
    at: float = field(init=False)

    def __post_init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        """Something moved: the wait starts again from now."""
        self.at = time.monotonic() + self.seconds

    def left(self) -> float:
        """Seconds until the deadline (0 past it)."""
        return max(0.0, self.at - time.monotonic())

    def error(self, detail: str = "") -> WaitTimeout:
        """The error for this wait: what, how long, which setting, and what was seen (`detail`)."""
        tail = f": {detail}" if detail else ""
        return WaitTimeout(f"{self.what} not done within {self.seconds:g}s ({self.setting}){tail}")

    def check(self, detail: Callable[[], str] = str) -> None:
        """Raise `error(detail())` once the deadline has passed (`detail` is asked only then: a loop
        checks often, and what it saw is worth describing only in the error)."""
        if time.monotonic() >= self.at:
            raise self.error(detail())
