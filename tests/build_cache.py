"""Demo asset builds kept across test runs, keyed on everything that decides their bytes.

The sentiment demo's build (~1.5 min) and the calculator's full build (~4 min on 2 cores) were paid on
every fresh clone. A build here runs the product's own CLI (`python -m demos.<name> --out DIR ...`) in
a subprocess that also records which of the project's source files it imported. The finished folder
is stored under the cache root with its inputs:

- the CLI module and its arguments;
- the SHA-256 of every project source file the build imported (whatever module that is, so no list
  of files to keep up to date by hand);
- the Python, torch, transformers, tokenizers and numpy versions and torch's CPU capability
  (floating-point results differ between AVX2 and AVX-512 kernels).

A later build with the same module and arguments reuses a stored folder only if all of that is equal
now; otherwise it builds again. The builders are deterministic (fixed seed and thread count,
`demos.common.quiet_deterministic_torch`), so a reused folder holds the bytes a build would write.

Cache root: `$RAYPPO_BUILD_CACHE`, else `$XDG_CACHE_HOME/rayppo/builds` (`~/.cache/rayppo/builds`);
`RAYPPO_BUILD_CACHE=off` builds every time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEEP = 2  # stored builds per module and arguments (older ones are removed)

# Runs `python -m MODULE ARGS` and writes the project files it imported (outside any venv) to RECORD.
_RECORDING_RUNNER = """
import json, runpy, sys
from pathlib import Path
repo, record, module = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.argv = [module, *sys.argv[4:]]
code = 0
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code
files = set()
for m in list(sys.modules.values()):
    f = getattr(m, "__file__", None)  # (torch has modules whose __file__ is a bare name)
    if f and Path(f).is_absolute() and "site-packages" not in f and Path(f).is_relative_to(repo):
        files.add(str(Path(f).resolve().relative_to(repo)))
Path(record).write_text(json.dumps(sorted(files)))
sys.exit(code)
"""


def cache_root() -> Path | None:
    env = os.environ.get("RAYPPO_BUILD_CACHE")
    if env == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rayppo" / "builds"


def environment() -> dict[str, str]:
    """The libraries and CPU kernels a build's numbers depend on (this interpreter's: the build runs
    with the same `sys.executable`)."""
    import platform

    import numpy
    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": numpy.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _matches(inputs: dict, env: dict) -> bool:
    return inputs["environment"] == env and all(
        _sha(REPO / rel) == digest for rel, digest in inputs["sources"].items()
    )


def _build(module: str, out: Path, args: tuple[str, ...]) -> dict[str, str | None]:
    """Runs the CLI (which publishes `out` whole); returns the project sources it imported, hashed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "sources.json"
        cmd = [
            sys.executable,
            "-c",
            _RECORDING_RUNNER,
            str(REPO),
            str(record),
            module,
            "--out",
            str(out),
            *args,
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssertionError(
                f"{module} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}"
                f"\n{proc.stderr[-3000:]}"
            )
        return {rel: _sha(REPO / rel) for rel in json.loads(record.read_text())}


def _publish_copy(src: Path, out: Path) -> None:
    """`src` copied to `out` whole: a sibling folder renamed into place. If another process published
    `out` meanwhile (e.g. `make train` building the same assets), its folder is kept."""
    tmp = out.with_name(f".{out.name}.from-cache-{uuid.uuid4().hex}")
    shutil.copytree(src, tmp)
    try:
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():
            raise


def cached_build(module: str, out: Path, *args: str) -> Path:
    """`python -m MODULE --out OUT ARGS`, or a stored folder of the same build published at `out`.
    Returns `out`."""
    from filelock import FileLock

    out = Path(out)
    root = cache_root()
    if root is None:
        _build(module, out, args)
        return out
    slot = root / module / hashlib.sha256(json.dumps(args).encode()).hexdigest()[:16]
    slot.mkdir(parents=True, exist_ok=True)
    env = environment()
    with FileLock(str(slot / ".lock")):
        entries = sorted((p for p in slot.iterdir() if (p / "inputs.json").is_file()), key=os.path.getmtime)
        for entry in reversed(entries):
            if _matches(json.loads((entry / "inputs.json").read_text()), env):
                _publish_copy(entry / "build", out)
                return out
        sources = _build(module, out, args)
        tmp = slot / f".new-{uuid.uuid4().hex}"
        shutil.copytree(out, tmp / "build")
        inputs = {"module": module, "args": list(args), "environment": env, "sources": sources}
        (tmp / "inputs.json").write_text(json.dumps(inputs, indent=1))
        os.replace(tmp, slot / uuid.uuid4().hex)
        for old in entries[: max(0, len(entries) + 1 - KEEP)]:
            shutil.rmtree(old, ignore_errors=True)
    return out
