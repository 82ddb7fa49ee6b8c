"""Peak device memory per process while a run goes on, named by the role each process plays.

The rule: a process is named by its Ray actor title (`ray::LearnerRank.step` -> `LearnerRank`), else
by its command, so several processes of one role report one peak (the largest). Read from `nvidia-smi`
every `every` seconds on a thread of its own; where `nvidia-smi` is absent (a CPU machine) nothing is
sampled and the peaks stay empty. Used by `bench/gpu_e2e.py` for its per-role memory columns.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path


class GpuSampler:
    """Peak device memory per process, from `nvidia-smi` every `every` s, named by the process's Ray
    title (`ray::LearnerRank.step` -> `LearnerRank`); nothing where `nvidia-smi` is absent."""

    def __init__(self, every: float = 0.2) -> None:
        self.every = every
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()

    def _loop(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self.every):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for line in out.splitlines():
                pid, _, mib = (p.strip() for p in line.partition(","))
                if pid.isdigit() and mib.isdigit():
                    name = role_of(int(pid))
                    self.peaks[name] = max(self.peaks.get(name, 0.0), int(mib) / 1024)


def role_of(pid: int) -> str:
    """The Ray actor class of process `pid` from its title (`ray::Class.method`), else its command."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return f"pid {pid}"
    if cmd.startswith("ray::"):
        return cmd[len("ray::") :].split(".")[0].split(" ")[0]
    return Path(cmd).name or f"pid {pid}"
