"""A trimmed Ray that fits in a lent GPU machine's 64 MiB carry (`make gpu-wheels`).

    python bench/trim_ray.py --wheel ray-2.60.0-cp312-...whl --out .gpu/ray-2.60.0-cp312-trimmed.tar.xz
    python bench/trim_ray.py --check .gpu/ray-2.60.0-cp312-trimmed.tar.xz --python python3.12

The device image has PyTorch, transformers and PEFT but no Ray, and nothing outside the machine can be
reached from it. Ray's cp312 wheel is 79 MB (201 MB unpacked); `cluster.train` on one machine needs
only what `ray.init()` (a local GCS, raylet, runtime-env agent, dashboard head and agent), actors,
placement groups and `ray.util.metrics` import. This script unpacks the wheel, removes what those never
import (`DROPPED`, each with its reason), strips the symbol tables of the ELF binaries, and packs what
is left (`ray/` and `ray-<version>.dist-info/`, its RECORD rewritten to what is kept) as an xz tarball
that `bench/gpu_e2e.sh` unpacks into site-packages with no registry.

Kept, and why (the project's own imports, `grep -rn "import ray\\|from ray" cluster learner ...`):
`ray/core` (gcs_server, raylet), `_raylet.so`, `_private` (with the runtime-env agent's vendored aiohttp:
the raylet starts that agent on every node), `dashboard` (`cluster.dashboard` defaults to on, and
`cluster.reporting.telemetry` reports through the dashboard agent's metrics), `util` (placement
groups, scheduling strategies, metrics, state API), `job_submission` (`cluster.submit`, `cluster.scale`),
`autoscaler` (the head's monitor process), `experimental`, `dag` and `widgets` (imported by
`ray._private.worker` at start), `cluster_utils` (tests), `scripts` (the `ray` CLI module).

Why dropping `DROPPED` is safe: no kept module imports any of them at import time (checked with
`grep -rnE "^(from|import) ray\\.(air|data|train|tune|serve|llm|rllib|workflow)"` over the kept tree:
no hit); the only lazy imports are inside the dashboard's serve/train/data modules, which are dropped
with them (the dashboard finds its modules by walking its package, so absent ones are not loaded);
the dashboard's web client is static files the head serves to a browser: its scripts, media and
profile viewer go, `client/build/` itself with `index.html` and `static/` stays (the head refuses to
start when that folder is missing, `FrontendNotFoundError`); a browser then gets a blank page, the
HTTP API (jobs, state, metrics) answers as before. `tests/test_trimmed_ray.py`
applies `trim` to this machine's Ray and starts a local cluster, an actor and a placement group on it;
`--check` does the same with the carried artefact itself as the device installs it (`check_carry`: a
bare venv of the device's Python, `bench/ray_deps.txt` from the artefact's folder with no index, the
tarball unpacked into site-packages), where a Python of that version is at hand.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import lzma
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Rule:
    """A path under the `ray` package that a local `cluster.train` does not need, and why."""

    path: str
    reason: str


DROPPED: tuple[Rule, ...] = (
    Rule("jars", "Java workers and cross-language calls (33 MB); the project runs Python actors only"),
    Rule("rllib", "RLlib, Ray's own RL library; the project has its own learner"),
    Rule("tune", "hyperparameter search; not imported by the project's runtime"),
    Rule("train", "Ray Train; the learner drives DeepSpeed itself"),
    Rule("data", "Ray Data; prompts are read by the project's own loaders"),
    Rule("serve", "Ray Serve; the agent gateway is the project's own FastAPI app"),
    Rule("llm", "Ray's LLM serving/batch library (on top of vLLM and Serve)"),
    Rule("air", "the shared layer of Train/Tune/Data; nothing kept imports it"),
    Rule("workflow", "a stub left for a removed library"),
    Rule(
        "dashboard/client/build/static/js",
        "the dashboard's browser client (7.5 MB of scripts); its HTTP API stays",
    ),
    Rule("dashboard/client/build/static/media", "the browser client's fonts and images"),
    Rule("dashboard/client/build/speedscope-1.5.3", "the browser client's profile viewer"),
    Rule("dashboard/modules/serve", "the dashboard's Serve endpoints (they import ray.serve)"),
    Rule("dashboard/modules/train", "the dashboard's Train endpoints (they import ray.train)"),
    Rule("dashboard/modules/data", "the dashboard's Data endpoints (they import ray.data)"),
)
STRIP_REASON = (
    "symbol tables of the ELF binaries (`strip --strip-unneeded`): only symbolized crash backtraces "
    "read them; the dynamic symbols a Python extension is loaded by stay"
)


@dataclass
class Trimmed:
    """What `trim` removed: bytes of the tree before and after, paths dropped, binaries stripped."""

    bytes_before: int = 0
    bytes_after: int = 0
    dropped: list[str] = field(default_factory=list)
    stripped: list[str] = field(default_factory=list)


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def trim(ray_dir: Path, strip: bool = True) -> Trimmed:
    """Remove `DROPPED` from the `ray` package at `ray_dir` (in place), and with `strip` strip the
    symbol tables of its ELF files where a `strip` program is found (skipped, and said so, where not)."""
    out = Trimmed(bytes_before=tree_bytes(ray_dir))
    for rule in DROPPED:
        target = ray_dir / rule.path
        if target.exists():
            shutil.rmtree(target)
            out.dropped.append(rule.path)
    for cache in list(ray_dir.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    program = shutil.which("strip") if strip else None
    if program:
        for path in sorted(ray_dir.rglob("*")):
            if path.is_file() and not path.is_symlink() and is_elf(path):
                before = path.stat().st_size
                subprocess.run([program, "--strip-unneeded", str(path)], check=True)
                if path.stat().st_size < before:
                    out.stripped.append(str(path.relative_to(ray_dir)))
    out.bytes_after = tree_bytes(ray_dir)
    return out


def rewrite_record(site: Path, dist_info: Path) -> None:
    """The dist-info's RECORD listing the files kept (pip's format: path,sha256=urlsafe-b64,size)."""
    rows = []
    for path in sorted(p for p in site.rglob("*") if p.is_file()):
        rel = path.relative_to(site).as_posix()
        if rel == f"{dist_info.name}/RECORD":
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        rows.append(f"{rel},sha256={digest},{path.stat().st_size}")
    rows.append(f"{dist_info.name}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(rows) + "\n")


def pack(site: Path, out: Path) -> None:
    """An xz tarball of `site`'s entries, deterministic (sorted, owner 0, mtime 0)."""

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for path in sorted(site.rglob("*")):
            tar.add(path, arcname=path.relative_to(site).as_posix(), recursive=False, filter=clean)


def build_from_wheel(wheel: Path, out: Path, strip: bool = True) -> dict:
    """Unpack `wheel`, trim its `ray/`, rewrite its RECORD, pack to `out`; returns the sizes."""
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
            for info in zf.infolist():  # zipfile drops the exec bits: raylet and gcs_server need them
                mode = info.external_attr >> 16
                if mode & 0o111:
                    (site / info.filename).chmod(mode & 0o777)
        (dist_info,) = site.glob("ray-*.dist-info")
        trimmed = trim(site / "ray", strip=strip)
        for script in ("serve", "tune"):  # console scripts of dropped libraries
            ep = dist_info / "entry_points.txt"
            ep.write_text("".join(ln for ln in ep.read_text().splitlines(True) if not ln.startswith(script)))
        rewrite_record(site, dist_info)
        pack(site, out)
    return {
        "wheel": wheel.name,
        "wheel_bytes": wheel.stat().st_size,
        "unpacked_ray_bytes": trimmed.bytes_before,
        "trimmed_ray_bytes": trimmed.bytes_after,
        "artefact": out.name,
        "artefact_bytes": out.stat().st_size,
        "dropped": [asdict(r) for r in DROPPED if r.path in trimmed.dropped],
        "stripped": trimmed.stripped,
    }


RAY_DEPS = Path(__file__).with_name("ray_deps.txt")

# The check a carried Ray must pass (`check_carry`): a local cluster as `bench/gpu_e2e.py` starts it on
# the device (no dashboard: its requirements are not carried), an actor in a placement group.
CARRY_CHECK = r"""
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=0.5)
class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n

pg = placement_group([{"CPU": 0.5}], strategy="STRICT_PACK")
ray.get(pg.ready())
actor = Counter.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg)).remote()
totals = [ray.get(actor.add.remote(k)) for k in (1, 2, 3)]
ray.kill(actor)
remove_placement_group(pg)
ray.shutdown()
assert totals == [1, 3, 6], totals
print("carried ray", ray.__version__, "ran a cluster, an actor and a placement group from", ray.__file__)
"""


def ray_deps() -> list[str]:
    """The names in `bench/ray_deps.txt` (one per line, # comments)."""
    lines = (ln.split("#")[0].strip() for ln in RAY_DEPS.read_text().splitlines())
    return [ln for ln in lines if ln]


def check_carry(artefact: Path, python: str, timeout: float = 300.0) -> str:
    """Install the carried Ray as `bench/gpu_e2e.sh` does on the device, into a new venv of `python`
    (the device's version): `ray_deps()` from the artefact's folder with no index, the tarball unpacked
    into site-packages; then run `CARRY_CHECK` there. Returns its last line; raises CalledProcessError
    (with its output) when a step fails."""
    import os

    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        py = str(venv / "bin" / "python")
        run = dict(check=True, capture_output=True, text=True, timeout=timeout)
        pip = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links"]
        subprocess.run([*pip, str(artefact.parent), *ray_deps()], **run)
        site = subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], **run
        ).stdout.strip()
        with tarfile.open(artefact, "r:xz") as tar:
            tar.extractall(site, filter="tar")
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("PYTHONPATH", None)
        out = subprocess.run([py, "-c", CARRY_CHECK], cwd=tmp, env=env, **run).stdout
    return out.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, help="Ray's wheel for the device's Python")
    ap.add_argument("--out", type=Path, help="the .tar.xz to write")
    ap.add_argument("--no-strip", action="store_true", help="keep the binaries' symbol tables")
    ap.add_argument("--check", type=Path, metavar="TARBALL", help="check a carried tarball (`check_carry`)")
    ap.add_argument("--python", default="python3.12", help="with --check: the device's Python version here")
    args = ap.parse_args()
    if args.check:
        try:
            print(check_carry(args.check, args.python), flush=True)
        except subprocess.CalledProcessError as err:
            raise SystemExit(f"the carried Ray failed its check: {err}\n{err.stdout}\n{err.stderr}") from None
        return
    if not (args.wheel and args.out):
        ap.error("--wheel and --out (or --check)")
    report = build_from_wheel(args.wheel, args.out, strip=not args.no_strip)
    args.out.with_suffix("").with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    mib = 2**20
    print(
        f"{report['wheel']}: {report['wheel_bytes'] / mib:.1f} MiB wheel, ray/ {report['unpacked_ray_bytes'] / mib:.1f}"
        f" -> {report['trimmed_ray_bytes'] / mib:.1f} MiB trimmed; {args.out.name}:"
        f" {report['artefact_bytes'] / mib:.1f} MiB"
    )


if __name__ == "__main__":
    main()
