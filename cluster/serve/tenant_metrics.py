"""Each tenant's metrics through the project's trackers (`run.loggers`' registry, `cluster.config.sinks`):
one tracker run per training client, one row per `optim_step`.

    <tracking.dir>/<owner>/<model_id>/metrics.jsonl     owner = sha256(API key)[:16], as checkpoints

A row (`StepRow`, step = the tenant's optim_step count after it) holds:

- `fb/<name>:<reduction>`: the metrics of the `forward_backward` calls since the previous step, folded
  across the calls the way the tinker SDK folds a call's chunks (`tinker/lib/chunked_fwdbwd_helpers.py`):
  `sum`, `min`, `max` over the calls, `mean` weighted by each call's number of data. Another reduction
  is refused (ValueError): every metric the service emits names one of these four.
- `fb/calls`, `fb/data`, `fb/tokens`: how many calls, data and input tokens the step trained on;
  `forward/calls`: the forward-only calls (`forward`) since the previous step (no gradients: not folded);
- `optim/<name>:<reduction>`: the step's own metrics (`TenantModel.optim_step`), and `optim/learning_rate`.

The sinks are the runs' own (jsonl is required: it is the record; tensorboard, wandb, mlflow take any row).
`prometheus` is refused here: its gauges are the trainer's named series (`cluster.reporting.telemetry`).
A tracker that fails is dropped as in a run (`RunLogger`); a metrics failure never fails the client's
call. A tenant restored after its actor died (`cluster.serve.recovery`) goes on in the same tracker run:
its next row's step is the restored count + 1, so steps after the death appear a second time.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, field_validator

from cluster.config.sections import MlflowSection, WandbSection, check_loggers
from cluster.reporting.trackers.base import RunInfo, StepRow
from cluster.reporting.trackers.run_logger import RunLogger
from kernel.strict import Strict

logger = logging.getLogger(__name__)

FOLDS = ("sum", "mean", "min", "max")  # the reductions folded across calls (the SDK's names)
NOT_SERVED = {"prometheus": "its gauges are the trainer's named series (cluster.reporting.telemetry)"}


class TrackingSection(Strict):
    """`tracking:` of the serve config: where each tenant's rows go."""

    loggers: list[str] = Field(["jsonl"], description="Trackers of each tenant (the run.loggers names).")
    dir: str = Field("runs/serve", description="Parent folder of the tenants' folders.")
    wandb: WandbSection = Field(default_factory=WandbSection, description="The 'wandb' logger.")
    mlflow: MlflowSection = Field(default_factory=MlflowSection, description="The 'mlflow' logger.")

    @field_validator("loggers")
    @classmethod
    def _loggers(cls, names: list[str]) -> list[str]:
        refused = [f"{n!r}: {NOT_SERVED[n]}" for n in names if n in NOT_SERVED]
        if refused:
            raise ValueError(f"tracking.loggers: not served for tenants: {'; '.join(refused)}")
        return check_loggers(names)


def fold(calls: list[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """The metrics of several forward_backward calls (each: its metrics, its number of data) as one:
    sum/min/max over the calls, mean weighted by data; a key missing from a call is left out (as the SDK
    does); a reduction other than FOLDS raises, naming it."""
    keys = set.intersection(*(set(m) for m, _ in calls)) if calls else set()
    out: dict[str, float] = {}
    for key in sorted(keys):
        reduction = key.rpartition(":")[2]
        values = [float(m[key]) for m, _ in calls]
        if reduction == "sum":
            out[key] = sum(values)
        elif reduction == "min":
            out[key] = min(values)
        elif reduction == "max":
            out[key] = max(values)
        elif reduction == "mean":
            weights = [n for _, n in calls]
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)
        else:
            raise ValueError(f"metric {key!r}: reduction {reduction!r} is not one of {FOLDS}")
    return out


@dataclass
class _Open:
    run: RunLogger
    calls: list[tuple[Mapping[str, float], int]] = field(default_factory=list)
    tokens: int = 0
    forwards: int = 0


class TenantMetrics:
    """The service's tracker runs, one per live tenant (opened at its creation, closed at its release)."""

    def __init__(self, tracking: TrackingSection) -> None:
        self.tracking = tracking
        self.open: dict[str, _Open] = {}

    def folder(self, owner: str, model_id: str) -> Path:
        who = hashlib.sha256(owner.encode()).hexdigest()[:16]
        return Path(self.tracking.dir) / who / model_id.replace(":", "-")

    def start(self, owner: str, model_id: str, about: dict) -> None:
        folder = self.folder(owner, model_id)
        folder.mkdir(parents=True, exist_ok=True)
        run = RunLogger(self.tracking.loggers)
        info = RunInfo(name=model_id, run_id=model_id, run_dir=folder, config=about, settings=self.tracking)
        run.open(info)
        self.open[model_id] = _Open(run)

    def forward_backward(self, model_id: str, metrics: Mapping[str, float], data: int, tokens: int) -> None:
        if (o := self.open.get(model_id)) is not None:
            o.calls.append((dict(metrics), data))
            o.tokens += tokens

    def forward(self, model_id: str) -> None:
        if (o := self.open.get(model_id)) is not None:
            o.forwards += 1

    def optim_step(self, model_id: str, steps: int, metrics: Mapping[str, float], lr: float) -> None:
        """One row: the calls since the previous step, folded, and this step's metrics."""
        o = self.open.get(model_id)
        if o is None:
            return
        try:
            row = {f"fb/{k}": v for k, v in fold(o.calls).items()}
            row |= {"fb/calls": len(o.calls), "fb/data": sum(n for _, n in o.calls), "fb/tokens": o.tokens}
            row |= {"forward/calls": o.forwards, "optim/learning_rate": lr}
            row |= {f"optim/{k}": float(v) for k, v in metrics.items()}
            o.run.step(StepRow(step=steps, metrics=row))
        except Exception as err:  # a metrics failure never fails the client's step
            logger.error("tenant %s: its step %d's metrics were not recorded: %s", model_id, steps, err)
        o.calls, o.tokens, o.forwards = [], 0, 0

    def close(self, model_id: str) -> None:
        if (o := self.open.pop(model_id, None)) is not None:
            o.run.close()
