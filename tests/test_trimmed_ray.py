"""The trimmed Ray `make gpu-wheels` carries to a lent GPU machine works, checked before a device is lent.

This machine has Python 3.11 and the device 3.12, so the carried cp312 build cannot run here; the same
`bench/trim_ray.trim` is applied to this venv's Ray instead (a copy), and a subprocess whose PYTHONPATH
puts the trimmed copy first starts a local cluster on it (dashboard on, as `cluster.dashboard`
defaults), runs an actor and a placement group, and shuts down.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from trim_ray import DROPPED, build_from_wheel, check_carry, trim  # noqa: E402

CHILD = r"""
import json, sys, urllib.request
from pathlib import Path
site = Path(sys.argv[1])
import ray
assert Path(ray.__file__).resolve().is_relative_to(site), ray.__file__
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

context = ray.init(address="local", num_cpus=1, include_dashboard=True, dashboard_host="127.0.0.1",
                   log_to_driver=False)

@ray.remote(num_cpus=0.5)
class Counter:
    def __init__(self):
        self.n = 0
    def add(self, k):
        self.n += k
        return self.n
    def where(self):
        import ray as r
        return r.__file__

pg = placement_group([{"CPU": 0.5}], strategy="STRICT_PACK")
ray.get(pg.ready())
actor = Counter.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg)).remote()
totals = [ray.get(actor.add.remote(k)) for k in (1, 2, 3)]
actor_ray = ray.get(actor.where.remote())
with urllib.request.urlopen(f"http://{context.dashboard_url}/api/version", timeout=30) as resp:
    version = json.loads(resp.read())
ray.kill(actor)
remove_placement_group(pg)
ray.shutdown()
print("RESULT " + json.dumps({"totals": totals, "actor_ray": actor_ray, "version": version}))
"""


def test_trim_drops_only_what_its_rules_name(tmp_path):
    """`trim` removes each rule's folder and nothing else of the package's top level."""
    pkg = tmp_path / "ray"
    for rel in [r.path for r in DROPPED] + ["_private", "util", "dashboard/modules/job"]:
        (pkg / rel).mkdir(parents=True, exist_ok=True)
        (pkg / rel / "x.py").write_text("x = 1\n")
    (pkg / "__init__.py").write_text("")
    out = trim(pkg, strip=False)
    assert sorted(out.dropped) == sorted(r.path for r in DROPPED)
    left = sorted(p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py"))
    assert left == ["__init__.py", "_private/x.py", "dashboard/modules/job/x.py", "util/x.py"]
    assert out.bytes_after == len("x = 1\n") * 3


@pytest.mark.slow
def test_trimmed_ray_starts_a_cluster_an_actor_and_a_placement_group(tmp_path):
    import ray

    source = Path(ray.__file__).resolve().parent
    site = tmp_path / "site"
    shutil.copytree(source, site / "ray", ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    trimmed = trim(site / "ray")
    assert trimmed.bytes_after < 0.75 * trimmed.bytes_before
    for rule in DROPPED:
        assert not (site / "ray" / rule.path).exists()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",  # Ray turns token auth on when ~/.ray/auth_token exists
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(site.resolve())],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result["totals"] == [1, 3, 6]
    assert Path(result["actor_ray"]).resolve().is_relative_to(site.resolve())
    assert result["version"]["ray_version"] == ray.__version__


def test_the_artefact_keeps_exec_bits_and_lists_what_it_holds(tmp_path):
    """`build_from_wheel` on a wheel of a few files: dropped folders absent, the raylet still
    executable (zipfile drops the bits, the tarball must restore them), RECORD listing exactly the
    files kept with their sha256, the dropped libraries' console scripts gone."""
    wheel = tmp_path / "ray-9.9.9-cp312-cp312-manylinux2014_x86_64.whl"
    files = {
        "ray/__init__.py": (b"x = 1\n", 0o644),
        "ray/core/src/ray/raylet/raylet": (b"#!/bin/sh\n", 0o755),
        "ray/jars/ray.jar": (b"java", 0o644),
        "ray/tune/__init__.py": (b"", 0o644),
        "ray-9.9.9.dist-info/METADATA": (b"Name: ray\n", 0o644),
        "ray-9.9.9.dist-info/RECORD": (b"stale\n", 0o644),
        "ray-9.9.9.dist-info/entry_points.txt": (
            b"[console_scripts]\nray = ray.scripts.scripts:main\nserve = x:y\ntune = x:z\n",
            0o644,
        ),
    }
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data)
    out = tmp_path / "ray.tar.xz"
    report = build_from_wheel(wheel, out, strip=False)
    assert [d["path"] for d in report["dropped"]] == ["jars", "tune"]
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        record = tar.extractfile("ray-9.9.9.dist-info/RECORD").read().decode().splitlines()
        entry = tar.extractfile("ray-9.9.9.dist-info/entry_points.txt").read().decode()
        kept = {n: tar.extractfile(n).read() for n in members}
    assert sorted(members) == [
        "ray-9.9.9.dist-info/METADATA",
        "ray-9.9.9.dist-info/RECORD",
        "ray-9.9.9.dist-info/entry_points.txt",
        "ray/__init__.py",
        "ray/core/src/ray/raylet/raylet",
    ]
    assert members["ray/core/src/ray/raylet/raylet"].mode & 0o111 == 0o111
    assert members["ray/__init__.py"].mode & 0o111 == 0
    assert "serve" not in entry and "tune" not in entry and "ray = ray.scripts.scripts:main" in entry
    rows = {r.split(",")[0]: r.split(",")[1:] for r in record}
    assert set(rows) == set(members)
    digest = base64.urlsafe_b64encode(hashlib.sha256(b"x = 1\n").digest()).rstrip(b"=").decode()
    assert rows["ray/__init__.py"] == [f"sha256={digest}", "6"]
    assert rows["ray-9.9.9.dist-info/RECORD"] == ["", ""]
    assert kept["ray/__init__.py"] == b"x = 1\n"


def _python312() -> str | None:
    for p in ["python3.12", *glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))]:
        ok = shutil.which(p) and subprocess.run(
            [p, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"], capture_output=True
        )
        if ok and ok.returncode == 0:
            return p
    return None


CARRIED = sorted((ROOT / ".gpu").glob("ray-*-cp312-trimmed.tar.xz"))


@pytest.mark.slow
@pytest.mark.skipif(not CARRIED, reason="no .gpu/ray-*-cp312-trimmed.tar.xz here (make gpu-wheels builds it)")
@pytest.mark.skipif(_python312() is None, reason="no Python 3.12 here to run the carried cp312 Ray")
def test_the_carried_ray_runs_in_a_bare_python312():
    """The carried artefact itself, installed as the device installs it (a bare venv, no index)."""
    assert "ran a cluster, an actor and a placement group" in check_carry(CARRIED[-1], _python312())
