"""The trimmed Ray `make gpu-wheels` carries to a lent GPU machine works, checked before a device is lent.

This machine has Python 3.11 and the device 3.12, so the carried cp312 build cannot run here; the same
`bench/trim_ray.trim` is applied to this venv's Ray instead (a copy), and a subprocess whose PYTHONPATH
puts the trimmed copy first starts a local cluster on it (dashboard on, as `cluster.dashboard`
defaults), runs an actor and a placement group, and shuts down.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from trim_ray import DROPPED, trim  # noqa: E402

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
