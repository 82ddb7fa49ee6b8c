"""Where a run's start-up time goes: marks from the driver's process start to the end of step 1.

The driver marks its own phases (`mark`); the actors report what they spent importing frameworks,
building their roles and initialising DeepSpeed (`ColocatedHost.startup_timings`). The breakdown is
printed after step 1 and written to `<run folder>/startup.json`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def process_start() -> float:
    """This process's start as a `time.time()` value (psutil comes with ray[default])."""
    import psutil

    return psutil.Process().create_time()


class StartupClock:
    def __init__(self) -> None:
        self.t0 = process_start()
        self.marks: dict[str, float] = {}  # phase -> seconds since the process started, in order
        self.actor: dict[str, float] = {}  # seconds inside the slowest actor, by phase

    def mark(self, phase: str) -> None:
        """`phase` ended now."""
        self.marks[phase] = time.time() - self.t0

    def phases(self) -> dict[str, float]:
        """Each phase's own seconds (from the previous mark to its own)."""
        out, last = {}, 0.0
        for phase, at in self.marks.items():
            out[phase] = at - last
            last = at
        return out

    def line(self) -> str:
        parts = [f"{phase} {sec:.1f}" for phase, sec in self.phases().items()]
        inside = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in self.actor.items())
        total = max(self.marks.values(), default=0.0)
        return f"start-up {total:.1f} s to the end of step 1: {', '.join(parts)}" + (
            f" (inside the learner's process: {inside})" if inside else ""
        )

    def write(self, run_dir: Path) -> None:
        doc = {"marks_s": self.marks, "phases_s": self.phases(), "learner_process_s": self.actor}
        (Path(run_dir) / "startup.json").write_text(json.dumps(doc, indent=2) + "\n")
