"""MLflow (`run.mlflow`): one MLflow run per training run, in experiment `run.mlflow.experiment` of the
tracking server `run.mlflow.tracking_uri` (MLflow's own default when unset: `MLFLOW_TRACKING_URI`, else `./mlruns`).

The resolved config goes in as params (dotted keys), step rows as metrics at their step (finite values:
MLflow stores no NaN), summaries as `<part>/<key>` metrics at the last step logged, artifacts as the run's
artifacts. On resume the checkpoint's MLflow run is continued: params it already holds are kept (MLflow
params never change), and a value changed since is logged beside it as `resumed/step_<N>/<param>` (N the
step resumed from; a warning names them), so the params tell both runs' settings. Steps the crashed run
logged past the checkpoint hold two values in the metric's history (both stay; the later one, by
timestamp, is the resumed run's), as `metrics.jsonl` keeps the rows the resumed run does not rewrite
(`cluster.reporting.metrics.truncate_metrics`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cluster.reporting.trackers.base import RunInfo, Sink, StepRow, flatten

logger = logging.getLogger(__name__)

MAX_PARAMS = 100  # params per log_batch call (MLflow's limit)
MAX_METRICS = 1000  # metrics per log_batch call


class MlflowSink(Sink):
    name = "mlflow"

    def open(self, run: RunInfo) -> str | None:
        from mlflow import MlflowClient

        s = run.settings.mlflow
        self._client: Any = MlflowClient(tracking_uri=s.tracking_uri)
        self._last = run.resume_step or 0
        resume_id = run.resume_ids.get(self.name)
        if resume_id:
            held = self._client.get_run(resume_id).data.params
            self._client.update_run(resume_id, status="RUNNING")
            self._run_id = resume_id
        else:
            held = {}
            experiment = self._client.get_experiment_by_name(s.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self._client.create_experiment(s.experiment)
            )
            created = self._client.create_run(
                experiment_id, run_name=run.run_id, tags={"rayppo.run": run.name}
            )
            self._run_id = created.info.run_id
        self._log_params(flatten(run.config), held, run.resume_step)
        return self._run_id

    def _log_params(self, params: dict[str, Any], held: Mapping[str, str], resume_step: int | None) -> None:
        """The params `held` lacks; on resume each changed one also as `resumed/step_<N>/<param>`."""
        from mlflow.entities import Param

        new = {k: str(v) for k, v in params.items() if k not in held}
        changed = sorted(k for k, v in params.items() if k in held and held[k] != str(v))
        if changed:
            prefix = f"resumed/step_{resume_step or 0}/"
            new.update({prefix + k: str(params[k]) for k in changed if prefix + k not in held})
            logger.warning(
                "mlflow: params changed on resume keep their first value (MLflow params never change); the "
                "resumed run's are logged as %s<param>: %s",
                prefix,
                changed,
            )
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), MAX_PARAMS):
            self._client.log_batch(self._run_id, params=items[i : i + MAX_PARAMS])

    def _log_metrics(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in StepRow(step, values).finite().items()]
        for i in range(0, len(items), MAX_METRICS):
            self._client.log_batch(self._run_id, metrics=items[i : i + MAX_METRICS])

    def log_step(self, row: StepRow) -> None:
        self._log_metrics(row.metrics, row.step)
        self._last = max(self._last, row.step)

    def log_summary(self, part: str, values: Mapping[str, float]) -> None:
        self._log_metrics({f"{part}/{k}": v for k, v in values.items()}, self._last)

    def log_artifact(self, path: Path) -> None:
        self._client.log_artifact(self._run_id, str(path))

    def close(self) -> None:
        self._client.set_terminated(self._run_id, "FINISHED")
