"""`python -m cluster.serve` in a process of its own (with its own local Ray) for the tests that drive it with
the real SDK: started on a config written from a dict, yielded once it prints `serving <url>`, stopped by
SIGTERM (uvicorn stops gracefully, then Ray shuts down with the process)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def serving(config: dict, folder: Path) -> Iterator[str]:
    with serving_process(config, folder) as (url, _proc):
        yield url


@contextmanager
def serving_process(config: dict, folder: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`serving`, yielding the service's process too (its Ray's workers are its descendants when it
    starts a local Ray)."""
    cfg = folder / "serve.yaml"
    defaults = {
        "port": 0,
        "checkpoint_dir": str(folder / "checkpoints"),
        "tracking": {"dir": str(folder / "tenants")},
    }
    cfg.write_text(json.dumps(defaults | config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.serve", str(cfg)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url, seen = None, []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("serving "):
            url = line.split()[1]
            break
    if url is None:
        proc.wait()
        pytest.fail("cluster.serve ended before serving:\n" + "".join(seen))
    try:
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=120)
