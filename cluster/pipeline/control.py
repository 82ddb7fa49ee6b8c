"""A named actor through which a running job is steered (scale roles) from outside.

The trainer polls it once per iteration; `python -m cluster.scale` writes to it. Its name is
derived from the Ray job submission id when the driver runs as a job, else from the run folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.roles.registry import group_names, scalable_names

NAMESPACE = "rayppo"
ROLES = scalable_names()  # the roles whose counts a running job can change


def control_name(run_id: str) -> str:
    return f"rayppo-control-{run_id}"


def current_run_id(run_dir: Path) -> str:
    """The job's submission id when running as a Ray job, else the run folder's name."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if raw:
        try:
            submission = json.loads(raw).get("metadata", {}).get("job_submission_id")
        except json.JSONDecodeError:
            submission = None
        if submission:
            return str(submission)
    return Path(run_dir).name


class RunControl:
    """Desired actor counts per role; the trainer applies them between iterations."""

    def __init__(self, initial: dict[str, int], fixed: str | None = None) -> None:
        self._targets = dict(initial)
        self._fixed = fixed  # why this run's counts cannot change (cluster.placement='colocated')

    def set_target(self, role: str, count: int) -> dict[str, int]:
        if self._fixed and role not in group_names():  # groups stand beside the plan in any placement
            raise ValueError(self._fixed)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; allowed: {', '.join(ROLES)}")
        if role not in self._targets:
            raise ValueError(
                f"this run has no {role} actors to scale (reference.source='policy_base': the learner ranks "
                f"compute it; reward.kind='judge': judge actors score and no reward scorer runs; any other "
                f"kind: no judge runs; agent runners run only with agent.function set); it scales "
                f"{', '.join(self._targets)}"
            )
        if int(count) < 1:
            raise ValueError(f"{role}: at least 1 actor is needed (got {count})")
        self._targets[role] = int(count)
        return dict(self._targets)

    def targets(self) -> dict[str, int]:
        return dict(self._targets)

    def ping(self) -> bool:
        return True
