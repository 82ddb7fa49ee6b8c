"""Which weight pushes also score the probe (`rollout.probe_every`).

Every push checks digests of the weights, which refuse a stale or partial load on any version. The
probe (teacher-forced logprobs of fixed sequences, on learner rank 0 and on every engine) is the check
that catches an engine holding the right weights but computing wrong logits, and it is a forward pass
on both sides. Its cost against a step depends on the size and the hardware, so its cadence is set by
what it costs:

- an int N probes v`version` when `version % N == 0`;
- 'auto' (the default) keeps the probe to `PROBE_SHARE` of the run's wall time: a probed push whose
  probe took c seconds (learner plus slowest engine) makes the next one due c / PROBE_SHARE seconds
  later. Measured on 2 CPU cores: c = 28 ms at the demo's 1M parameters against a 0.45 s step (every
  push probed was the whole step-time regression of #57), 11-19 s at 0.5B; on the H200 0.1-0.3 s at
  0.5B. A push whose probe cost nothing measurable leaves the next one due at once.

Whatever the cadence, a worker's first push is probed (the publisher asks for that).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PROBE_SHARE = 0.02  # 'auto': at most this share of the wall time goes to the probe


@dataclass
class ProbeCadence:
    every: int | str  # rollout.probe_every: an int >= 1 or 'auto'
    clock: Callable[[], float] = time.monotonic
    next_at: float = field(default=-math.inf)  # 'auto': the probe is due from this clock reading

    def due(self, version: int) -> bool:
        """Whether pushing v`version` scores the probe (before asking about first pushes)."""
        if self.every == "auto":
            return self.clock() >= self.next_at
        return version % int(self.every) == 0

    def spent(self, seconds: float) -> None:
        """A probed push's probe took `seconds`: under 'auto' the next one waits seconds / PROBE_SHARE."""
        if self.every == "auto":
            self.next_at = self.clock() + max(seconds, 0.0) / PROBE_SHARE

    @staticmethod
    def cost(stages: dict[str, float]) -> float:
        """The probe's seconds in a push's stages: the learner's and the slowest engine's."""
        return stages.get("learner_probe_s", 0.0) + stages.get("worker_probe_s", 0.0)
