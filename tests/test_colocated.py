"""cluster.placement='colocated': every role of a learner rank in that rank's process, same results.

Real Ray, real DeepSpeed, the real demo models: the colocated run must give the separate run's
numbers (same seeds, chunks and thread counts per role: the same arithmetic in fewer processes).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from demo_run import CONFIG, demo_overrides

from cluster.config.schema import ConfigError, load_config
from cluster.pipeline.run import Run
from cluster.placement.colocated import RoleView

ROOT = Path(__file__).resolve().parent.parent
# One chunk per step: the colocated placement splits a batch evenly over its workers (one here), so
# the separate run draws the same chunk with the same seed.
SMALL = {"data.prompts_per_step": 16, "rollout.chunk_size": 16, "learner.micro_batch_size": 8}
# Metrics that measure time or the process layout, not the arithmetic.
NOT_ARITHMETIC = (
    "time/",
    "train/compute_s",  # the learner ranks' own seconds
    "throughput/",
    "scale/",
    "pipeline/",
    "rollout/queue_depth",
    "weights/learner_",  # the weight push's stage times
    "weights/worker_",
)


def _run(cfg, folder: Path, steps: int):
    trainer = Run(cfg, folder)
    try:
        rows = [trainer.iteration() for _ in range(steps)]
        layout = {
            "hosts": len(trainer.roles.hosts),
            "views": all(isinstance(h, RoleView) for p in trainer.roles.pools() for h in p.handles),
        }

        def collector(actor) -> tuple[bool, bool]:  # in the actor's process (shipped by value)
            import gc

            return gc.isenabled(), gc.get_freeze_count() > 0

        # every process of the run: the hosts, or the learner ranks and the role actors
        actors = trainer.roles.hosts or [
            *trainer.roles.ranks,
            *(h for p in trainer.roles.pools() for h in p.handles),
        ]
        layout["collector"] = set(ray.get([a.__ray_call__.remote(collector) for a in actors], timeout=60))
        try:
            ray.get(trainer.control.set_target.remote("rollout", 2))
            layout["scaling"] = "accepted"
        except ray.exceptions.RayTaskError as err:
            layout["scaling"] = str(err.cause)
    finally:
        trainer.close()
    return rows, layout


@pytest.mark.slow
def test_colocated_gives_the_separate_runs_numbers(ray_local, demo_assets, tmp_path):
    steps = 4
    results = {}
    for placement in ("separate", "colocated"):
        cfg = load_config(
            CONFIG, demo_overrides(demo_assets, steps, **SMALL, **{"cluster.placement": placement})
        )
        results[placement] = _run(cfg, tmp_path / placement, steps)
    (sep, sep_layout), (col, col_layout) = results["separate"], results["colocated"]
    assert sep_layout["hosts"] == 0 and col_layout["hosts"] == 1  # one process holds all four roles
    assert col_layout["views"]
    # after start-up (cluster/roles/startup.py): the collector on again, what start-up built frozen
    assert sep_layout["collector"] == col_layout["collector"] == {(True, True)}
    assert "colocated" in col_layout["scaling"] and sep_layout["scaling"] == "accepted"
    compared = 0
    for step, (a, b) in enumerate(zip(sep, col, strict=True), start=1):
        assert b["policy_version"] == step
        for key, want in a.items():
            if key.startswith(NOT_ARITHMETIC) or key == "faults/actor_replacements":
                continue
            got = b[key]
            # Tolerance: the same float operations in the same order give the same bits here; 1e-6
            # relative leaves room for a BLAS that picks kernels by the process's thread pool.
            assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) or (
                math.isnan(got) and math.isnan(want)
            ), f"step {step} {key}: separate {want} colocated {got}"
            compared += 1
    assert compared > 4 * 20


@pytest.mark.slow
def test_colocated_two_ranks_share_the_bundle_with_the_second_host(ray_local, demo_assets, tmp_path):
    """Worker 1 lives on learner rank 1's host: it loads rank 0's object-store copy, acknowledged by
    its own engine's probe logprobs (as every push is)."""
    extra = {**SMALL, "cluster.placement": "colocated", "learner.num_ranks": 2, "rollout.num_workers": 2}
    extra |= {"learner.num_cpus_per_rank": 0.5, "rollout.num_cpus_per_worker": 0.25}
    cfg = load_config(CONFIG, demo_overrides(demo_assets, 2, **extra))
    trainer = Run(cfg, tmp_path / "run")
    try:
        rows = [trainer.iteration() for _ in range(2)]
        versions = ray.get([h.version.remote() for h in trainer.roles.workers.handles], timeout=60)
        assert len(trainer.roles.hosts) == 2
        assert trainer.weights.bundle is not None  # the shared copy the second host loaded
    finally:
        trainer.close()
    assert versions == [2, 2]
    assert [r["policy_version"] for r in rows] == [1.0, 2.0]
    assert all(math.isfinite(r["loss/policy"]) for r in rows)


def test_colocated_config_errors_name_the_fields(demo_assets):
    cases = {
        ("pipeline.mode=async", "learner.off_policy=tis"): "pipeline.mode='async'",
        ("rollout.weight_sync=collective",): "rollout.weight_sync='collective'",
        ("rollout.num_workers=2",): "rollout.num_workers=2 > learner.num_ranks=1",
        ("reference.resources={ref_node: 1}",): "reference.resources",
    }
    for sets, needle in cases.items():
        overrides = demo_overrides(demo_assets, 1, **{"cluster.placement": "colocated"}) + list(sets)
        with pytest.raises(ConfigError) as err:
            load_config(CONFIG, overrides)
        assert "cluster.placement='colocated'" in str(err.value) and needle in str(err.value)
    with pytest.raises(ConfigError, match="separate.*colocated"):
        load_config(CONFIG, [*demo_overrides(demo_assets, 1), "cluster.placement=shared"])


def test_views_ask_for_two_returns_where_the_roles_return_two():
    """A `RoleView` returns what the role's own actor would: two references for the methods that
    return (facts, payload) (the driver reads the first only), one for every other method. Each
    role's descriptor names its two-return methods; here they are read off its actor class."""
    import inspect

    from cluster.roles.registry import ROLES

    for role in ROLES:
        two = {
            name
            for name, fn in inspect.getmembers(role.actor_class(), inspect.isfunction)
            if getattr(fn, "__ray_num_returns__", 1) == 2
        }
        assert two == role.two_returns, role.name


def test_the_driver_imports_no_framework():
    """The driver starts actors and moves records: torch, transformers and DeepSpeed load in the
    processes that compute (its tokenizer loads transformers later, while the actors start)."""
    code = (
        "import json, sys\n"
        "import cluster.train, cluster.pipeline.run, cluster.pipeline.sync_pipeline, cluster.pipeline.stream_pipeline, cluster.placement.launch, cluster.placement.colocated, cluster.roles.registry, cluster.scale\n"
        "print(json.dumps([m for m in ('torch', 'transformers', 'deepspeed', 'vllm') if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_an_actor_imports_only_its_own_roles_frameworks():
    """An actor's process imports the module of its class: the rollout worker's, the reference's and
    the scorer's never import DeepSpeed (the learner rank's alone needs it)."""
    code = (
        "import json, sys\n"
        "import cluster.roles.actors\n"
        "print(json.dumps([m for m in ('deepspeed', 'learner.rank') if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.slow
def test_colocated_engine_sleeps_while_the_learner_trains(ray_local, demo_assets, tmp_path):
    """rollout.sleep_level=1 (what colocation on GPUs sets): the engine sleeps before each learner
    step and wakes before the new weights load (a load or a generate on a sleeping engine raises, so a
    wrong order fails the run). On CPU the hf engine has nothing to free; the order is what is tested."""
    extra = {**SMALL, "cluster.placement": "colocated", "rollout.sleep_level": 1}
    cfg = load_config(CONFIG, demo_overrides(demo_assets, 3, **extra))
    trainer = Run(cfg, tmp_path / "run")
    try:
        for _ in range(3):
            trainer.iteration()
        stats = ray.get(trainer.roles.workers.handles[0].stats.remote(), timeout=60)
        version = ray.get(trainer.roles.workers.handles[0].version.remote(), timeout=60)
    finally:
        trainer.close()
    assert (stats["sleeps"], stats["wakes"], stats["sleep_level"]) == (3, 3, 0)
    assert version == 3


def test_sleep_level_needs_colocation(demo_assets):
    with pytest.raises(ConfigError, match="rollout.sleep_level=1 .*cluster.placement='colocated'"):
        load_config(CONFIG, [*demo_overrides(demo_assets, 1), "rollout.sleep_level=1"])
    sets = {"cluster.placement": "colocated", "learner.num_gpus_per_rank": 1}
    from cluster.placement.rollout_gpus import worker_config

    on_gpus = load_config(CONFIG, demo_overrides(demo_assets, 1, **sets))
    assert worker_config(on_gpus).sleep_level == 1  # unset: colocated on GPUs sleeps
    explicit = load_config(CONFIG, [*demo_overrides(demo_assets, 1, **sets), "rollout.sleep_level=0"])
    assert worker_config(explicit).sleep_level == 0
    on_cpus = load_config(CONFIG, demo_overrides(demo_assets, 1, **{"cluster.placement": "colocated"}))
    assert worker_config(on_cpus).sleep_level == 0
