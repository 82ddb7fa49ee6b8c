"""The one thing the trainer logs through: every record goes to every sink of `run.loggers`.

A sink that raises (network down, server gone, a bad value) is reported once, closed if it can be, and
dropped; the run goes on with the others. An `essential` sink (the JSONL record) is never dropped: its
failure is the run's. Only the driver holds a run logger.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from cluster.config.sinks import SINKS
from cluster.reporting.trackers.base import RunInfo, Sink, StepRow

logger = logging.getLogger(__name__)


class RunLogger:
    def __init__(self, names: list[str]) -> None:
        self.sinks: list[Sink] = [SINKS[name].load()() for name in names]
        self.ids: dict[str, str] = {}  # tracker run ids by sink name, kept in checkpoints
        self.dropped: dict[str, str] = {}  # sink name -> the error that dropped it
        self.opened = False

    def open(self, run: RunInfo) -> None:
        """Open every sink's run (continuing `run.resume_ids` when resuming)."""
        self.ids = dict(run.resume_ids)
        for sink in list(self.sinks):
            self._call(sink, "open", lambda s=sink: self._remember(s, s.open(run)))
        self.opened = True

    def _remember(self, sink: Sink, run_id: str | None) -> None:
        if run_id is not None:
            self.ids[sink.name] = run_id

    def step(self, row: StepRow) -> None:
        self._each("log_step", lambda s: s.log_step(row))

    def summary(self, part: str, values: Mapping[str, float]) -> None:
        self._each("log_summary", lambda s: s.log_summary(part, values))

    def artifact(self, path: Path) -> None:
        self._each("log_artifact", lambda s: s.log_artifact(Path(path)))

    def close(self) -> None:
        self._each("close", lambda s: s.close())
        self.sinks, self.opened = [], False

    def _each(self, what: str, call: Callable[[Sink], None]) -> None:
        """`call` on every sink still in; nothing before `open` (a run stopped during its set-up)."""
        if not self.opened:
            return
        for sink in list(self.sinks):
            self._call(sink, what, lambda s=sink: call(s))

    def _call(self, sink: Sink, what: str, call: Callable[[], None]) -> None:
        if sink.essential:
            call()
            return
        try:
            call()
        except Exception as err:  # noqa: BLE001 - a tracker never stops the run
            self.sinks.remove(sink)
            self.dropped[sink.name] = f"{type(err).__name__}: {err}"
            logger.warning("logger %r dropped after %s failed: %s; the run goes on", sink.name, what, err)
            if what not in ("open", "close"):
                with contextlib.suppress(Exception):  # it is dropped already
                    sink.close()
