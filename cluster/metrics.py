"""Per-step metrics to JSONL (always) and TensorBoard (when installed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                self._tb = None

    @property
    def tensorboard_dir(self) -> str | None:
        return self._tb.log_dir if self._tb is not None else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (float(v) if v is not None else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if v is not None and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def truncate_metrics(path: str | Path, last_step: int) -> list[dict[str, float]]:
    """Keep only rows up to `last_step` (a resumed run rewrites what came after its checkpoint)."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = [r for r in read_metrics(path) if r["step"] <= last_step]
    path.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in rows))
    return rows
