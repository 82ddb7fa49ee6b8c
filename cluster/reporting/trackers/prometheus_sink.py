"""Ray metrics for Prometheus and the Ray dashboard: the live gauges of `cluster.reporting.telemetry.Telemetry`.

A training step's row updates the gauges and totals; a held-out-only row (the evaluation before
training, at step 0, and after it, at the last step) updates the eval gauges only. Live values hold no
history, so there is nothing to resume: the resumed driver's series carry the same `run` tag.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cluster.reporting.telemetry import Telemetry
from cluster.reporting.trackers.base import RunInfo, Sink, StepRow


class PrometheusSink(Sink):
    name = "prometheus"

    def open(self, run: RunInfo) -> str | None:
        self.telemetry = Telemetry(run.run_id)
        return None

    def log_step(self, row: StepRow) -> None:
        if row.held_out_only:
            self.telemetry.record_eval(dict(row.metrics))
        else:
            self.telemetry.record_step(dict(row.metrics), worker_lags=dict(row.worker_lags))

    def log_summary(self, part: str, values: Mapping[str, float]) -> None:
        """Gauges follow the rows only: the `EVAL_AFTER` summary came as the last (held-out-only) row."""

    def log_artifact(self, path: Path) -> None:
        """Gauges hold numbers only."""

    def close(self) -> None:
        """Ray keeps exporting the last values until the driver disconnects."""
