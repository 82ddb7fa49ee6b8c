"""The run's own record in its folder: `metrics.jsonl` (one row per step, and the held-out evaluations
before and after training: step 0's row and a second row of the last step, told apart by
`cluster.reporting.metrics.held_out_only`) and `summary.json`.

It never stops: its failure is the run's. Rows after a resumed checkpoint were already cut by the
trainer's restore (`cluster.reporting.metrics.truncate_metrics`), so the resumed run appends its own.
Artifacts are files of the run folder already.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cluster.reporting.trackers.base import RunInfo, Sink, StepRow


class JsonlSink(Sink):
    name = "jsonl"
    essential = True

    def open(self, run: RunInfo) -> str | None:
        self.path = run.run_dir / "metrics.jsonl"
        self.summary_path = run.run_dir / "summary.json"
        self._file: Any = self.path.open("a")
        return None

    def log_step(self, row: StepRow) -> None:
        clean = {k: (float(v) if v is not None else None) for k, v in row.metrics.items()}
        self._file.write(json.dumps({"step": row.step, **clean}, allow_nan=True) + "\n")
        self._file.flush()

    def log_summary(self, part: str, values: Mapping[str, float]) -> None:
        doc = json.loads(self.summary_path.read_text()) if self.summary_path.is_file() else {}
        doc[part] = dict(values)
        self.summary_path.write_text(json.dumps(doc, indent=2, allow_nan=True) + "\n")

    def log_artifact(self, path: Path) -> None:
        """The artifacts are the run folder's own files."""

    def close(self) -> None:
        self._file.close()
