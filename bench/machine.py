"""Watching the machine during a benchmark: CPU used by others, peak memory of a process tree or of
one process, what the machine is (cores, memory, memory-copy bandwidth)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{Path(sys.argv[0]).stem}] {msg}", file=sys.stderr, flush=True)


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


class PeakRSS:
    """Peak RSS of one process (default this one) since `reset`, sampled every `interval_s` on a thread;
    `extra()` is the peak over the RSS at `reset`."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.005) -> None:
        import psutil

        self._proc, self._interval = psutil.Process(pid), interval_s
        self.base = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return self._proc.memory_info().rss

    def reset(self) -> None:
        self.base = self.peak = self.rss()

    def extra(self) -> int:
        return max(self.peak, self.rss()) - self.base

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.rss())
            except psutil.Error:  # the process is gone
                return
            time.sleep(self._interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def describe() -> dict:
    """Cores (logical, physical), CPU model, total and available memory of this machine."""
    import psutil

    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "unknown",
    )
    mem = psutil.virtual_memory()
    return {
        "cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "cpu": model,
        "ram_gib": mem.total / 2**30,
        "available_gib": mem.available / 2**30,
    }


def memcpy_gbps(nbytes: int, threads: int, reps: int = 5) -> float:
    """Median bytes copied per second (1e9) by torch `copy_` between two `nbytes` buffers with `threads`
    torch threads (pages touched by a first copy, not timed). Run it in a process of its own: it
    holds 2 x nbytes while it runs."""
    import statistics

    import torch

    torch.set_num_threads(threads)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9
