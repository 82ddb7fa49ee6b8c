"""Watching the machine during a benchmark: CPU used by others, peak memory of a process tree."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[compare_trl] {msg}", file=sys.stderr, flush=True)


def machine_busy_s() -> float:
    """CPU seconds the machine has spent busy since boot (all cores)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def pss_mb(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    return next((int(ln.split()[1]) / 1024.0 for ln in text.splitlines() if ln.startswith("Pss:")), None)


class TreeSampler(threading.Thread):
    """Peak PSS summed over a process and all its descendants, the CPU they used, and everyone else's."""

    def __init__(self, pid: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s, self.peak_pss_mb = pid, interval_s, 0.0
        self.cpu: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds last seen
        self._halt = threading.Event()
        self._t = [(time.monotonic(), machine_busy_s(), sum(os.times()[:2]))]

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0.0
        for p in procs:
            try:
                with p.oneshot():
                    ct, rss = p.cpu_times(), p.memory_info().rss / 2**20
                    self.cpu[(p.pid, p.create_time())] = sum(ct[:4])  # user, system, children's
            except psutil.Error:
                continue
            total += pss_mb(p.pid) or rss
        self.peak_pss_mb = max(self.peak_pss_mb, total)

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval_s)

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join()
        self._t.append((time.monotonic(), machine_busy_s(), sum(os.times()[:2])))
        (t0, b0, m0), (t1, b1, m1) = self._t
        tree = sum(self.cpu.values())
        foreign = max(0.0, (b1 - b0) - tree - (m1 - m0)) / max((t1 - t0) * (os.cpu_count() or 1), 1e-9)
        return {"peak_pss_mb": self.peak_pss_mb, "tree_cpu_s": tree, "foreign_cpu_frac": foreign}


def wait_for_idle(max_wait_s: float, threshold: float = 0.1, window_s: float = 2.0) -> None:
    """Wait at most max_wait_s for other processes to leave the CPUs (under `threshold` of them busy)."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        t0, b0 = time.monotonic(), machine_busy_s()
        time.sleep(window_s)
        share = (machine_busy_s() - b0) / ((time.monotonic() - t0) * (os.cpu_count() or 1))
        if share < threshold:
            return
        log(f"machine busy ({share:.0%} of the CPUs used by other processes); waiting")
