"""Weights & Biases (`run.wandb`): one W&B run per training run, its folder under `<run folder>/wandb/`.

The resolved config is the W&B run's config; step rows are `log(..., step=step)`; summaries go to the
run's summary as `<part>/<key>`; artifacts are saved with the run's files. On resume the W&B run of the
checkpoint is continued (`id=..., resume="must"`). W&B keeps a run's steps increasing: rows of steps the
crashed run already logged past the checkpoint stay, and W&B refuses the resumed run's rows of those
steps (with a warning); every later step is the resumed run's. Offline (`mode: offline`), each start
writes an `offline-run-*` folder with the same run id: `wandb sync` them in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cluster.reporting.trackers.base import RunInfo, Sink, StepRow


class WandbSink(Sink):
    name = "wandb"

    def open(self, run: RunInfo) -> str | None:
        import wandb

        s = run.settings.wandb
        resume_id = run.resume_ids.get(self.name)
        self._dir = run.run_dir
        self._run: Any = wandb.init(
            project=s.project,
            entity=s.entity,
            mode=s.mode,
            tags=list(s.tags),
            name=run.run_id,
            dir=str(run.run_dir),
            config=run.config,
            id=resume_id,
            resume="must" if resume_id else None,
            settings=wandb.Settings(console="off"),  # the driver's log stays the driver's
        )
        return self._run.id

    def log_step(self, row: StepRow) -> None:
        metrics = {k: float(v) for k, v in row.metrics.items() if v is not None}
        self._run.log(metrics, step=row.step)

    def log_summary(self, part: str, values: Mapping[str, float]) -> None:
        self._run.summary.update({f"{part}/{k}": v for k, v in values.items()})

    def log_artifact(self, path: Path) -> None:
        self._run.save(str(path), base_path=str(self._dir), policy="now")

    def close(self) -> None:
        self._run.finish()
