"""TensorBoard event files in `<run folder>/tensorboard/`.

Scalars per step (finite values only); summaries as scalars at the last step logged; a PNG artifact
as an image, a text artifact as text. On resume the writer purges what the crashed run logged after
the checkpoint's step (`SummaryWriter(purge_step=...)`), so TensorBoard shows the resumed run's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cluster.reporting.trackers.base import RunInfo, Sink, StepRow

TEXT_SUFFIXES = (".json", ".yaml", ".txt")


class TensorBoardSink(Sink):
    name = "tensorboard"

    def open(self, run: RunInfo) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        purge = run.resume_step + 1 if run.resume_step is not None else None
        self._tb: Any = SummaryWriter(str(run.run_dir / "tensorboard"), purge_step=purge)
        self._last = run.resume_step or 0
        return None

    def log_step(self, row: StepRow) -> None:
        for key, value in row.finite().items():
            self._tb.add_scalar(key, value, row.step)
        self._tb.flush()
        self._last = max(self._last, row.step)

    def log_summary(self, part: str, values: Mapping[str, float]) -> None:
        for key, value in StepRow(self._last, values).finite().items():
            self._tb.add_scalar(f"{part}/{key}", value, self._last)
        self._tb.flush()

    def log_artifact(self, path: Path) -> None:
        if path.suffix == ".png":
            import numpy as np
            from PIL import Image

            image = np.asarray(Image.open(path).convert("RGB"))
            self._tb.add_image(path.stem, image, self._last, dataformats="HWC")
        elif path.suffix in TEXT_SUFFIXES:
            self._tb.add_text(path.name, f"```\n{path.read_text()}\n```", self._last)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()
