"""Graceful stop: SIGINT or SIGTERM ends the run at the next safe point (the end of the current
learner step), which then writes a checkpoint, prints its summary and stops every actor it started.

Exit codes: 130 after SIGINT, 143 after SIGTERM (128 + the signal's number, the shell's convention).
A second signal, or `checkpoint.stop_grace_s` passing before the step ends, forces the stop: the
step is abandoned (KeyboardInterrupt), no new checkpoint is written, the last one stays resumable.

Handlers are installed after `ray.init`: it sets its own SIGTERM handler (`sys.exit`), and Ray's C++
core chains abseil's failure-signal handler in front of it, which arms a 3 s SIGALRM abort (the
driver's exit 134 on SIGTERM). `signal.signal` replaces both at the OS level.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
from typing import Any

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The stop asked for by a signal (or `request()`); the trainer polls `requested` between steps."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int | None:
        return EXIT_CODES.get(self.signum) if self.signum is not None else None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def install(self) -> None:
        """Handle SIGINT and SIGTERM until `uninstall` (only the main thread may; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        self.reached_safe_point()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.request(signum)

    def request(self, signum: int) -> None:
        """First call: stop at the next safe point (and start the grace timer). Later calls: force."""
        if self.signum is not None:
            print(
                f"\n{signal.Signals(signum).name} again: stopping now, without a new checkpoint", flush=True
            )
            self.reached_safe_point()
            raise KeyboardInterrupt(f"forced stop ({signal.Signals(signum).name})")
        self.signum = signum
        print(
            f"\n{self.name}: stopping after the current learner step, then writing a checkpoint "
            f"(send it again, or wait {self.grace_s:.0f}s, to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        self._timer = threading.Timer(self.grace_s, self._grace_over)
        self._timer.daemon = True
        self._timer.start()

    def _grace_over(self) -> None:
        print(
            f"\nthe current step did not end within {self.grace_s:.0f}s (checkpoint.stop_grace_s)", flush=True
        )
        _thread.interrupt_main(self.signum)  # runs `_on_signal` again in the main thread: forced

    def reached_safe_point(self) -> None:
        """The step ended: the grace period no longer applies (checkpoint and shutdown may take longer)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
