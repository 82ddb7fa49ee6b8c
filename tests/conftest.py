"""Shared fixtures: tiny models on disk, a local Ray cluster, DeepSpeed /dev/shm clean-up."""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    from tiny_models import build_policy

    return build_policy(tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory) -> Path:
    from tiny_models import build_classifier

    return build_classifier(tmp_path_factory.mktemp("tiny_reward"))


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray cluster for the session (logical CPUs > cores so fractional actors fit)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    yield ray
    ray.shutdown()


def _clean_shm() -> None:
    for f in glob.glob("/dev/shm/deepspeed_allreduce_buffer*"):
        with contextlib.suppress(OSError):
            os.remove(f)


@pytest.fixture(scope="session", autouse=True)
def _deepspeed_shm_cleanup():
    yield
    _clean_shm()


@pytest.fixture(scope="session")
def demo_assets():
    """The real demo assets in the repo's assets/ folder (shared with `make train`): a missing folder
    is filled by the default build, from tests/build_cache.py's store when its inputs are unchanged."""
    from build_cache import cached_build

    from demos.sentiment import ensure_assets

    root = Path(__file__).resolve().parent.parent / "assets" / "sentiment_tiny"
    if not root.exists():
        cached_build("demos.sentiment", root, "--quiet")
    return ensure_assets(root, quiet=True)  # up to date: checks the build's settings, builds nothing


@pytest.fixture(scope="session")
def sync_demo_rows(ray_local, demo_assets, tmp_path_factory) -> list[dict]:
    """The sync pipeline's first 3 steps of the small demo (tests/demo_run.SMALL_STEPS), run once per
    session for every test that compares another path with it: the one-process loop
    (test_sync_regression.py) and async mode at eta = 0 (test_streaming.py)."""
    from demo_run import CONFIG, SMALL_STEPS, SYNC_DEMO_STEPS, demo_overrides, train_rows

    from cluster.config.schema import load_config

    cfg = load_config(CONFIG, demo_overrides(demo_assets, SYNC_DEMO_STEPS, **SMALL_STEPS))
    return train_rows(cfg, tmp_path_factory.mktemp("sync_demo") / "run", SYNC_DEMO_STEPS)


# One marker per area, so a change is checked in minutes: `make test AREA=learner` (or
# `pytest -m "learner and slow"`). A test file belongs to the first area whose patterns match its
# name; a file no pattern matches is `cluster`'s (the pipeline, placement, weights and operations).
AREAS: dict[str, tuple[str, ...]] = {
    "learner": (
        "test_learner_*",
        "test_advantages*",
        "test_algorithms*",
        "test_critic*",
        "test_logits_paths*",
        "test_micro_batches*",
        "test_multiturn_learner*",
        "test_off_policy*",
        "test_overlong*",
        "test_packing*",
        "test_sequences*",
    ),
    "rollout": (
        "test_rollout_*",
        "test_engine_*",
        "test_episodes*",
        "test_chat_turns*",
        "test_environment_hosts*",
        "test_partial_rollout_engines*",
        "test_tools*",
        "test_gateway*",
        "test_vllm_*",
    ),
    "reward": ("test_reward_*", "test_pass_at_k*"),
    "data": (
        "test_chat_data*",
        "test_chat_tools*",
        "test_data_preview*",
        "test_gsm8k_example*",
        "test_config*",
        "test_bad_input*",
    ),
    "demos": ("test_demo_*",),
    "bench": ("test_bench_*", "test_async_sim*"),
}


def area_of(filename: str) -> str:
    import fnmatch

    return next(
        (area for area, pats in AREAS.items() if any(fnmatch.fnmatch(filename, p) for p in pats)), "cluster"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, area_of(Path(str(item.fspath)).name)))


# DeepSpeed's cpu_adam op is JIT-built with g++ the first time a venv uses it (~2 min on 2 cores; a
# new venv path is a new build, since ninja sees new include paths). When a selected test needs it
# (marker `cpu_adam`), the build starts as the session starts, at the lowest CPU priority, so it
# fills the time the end-to-end tests leave idle; the test that needs it loads the finished op, or
# waits on torch's own build lock until it is done. Never killed: a build stopped midway would
# leave that lock behind for the next run.
_BUILDS: list[subprocess.Popen] = []
BUILD_CPU_ADAM = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"


def pytest_collection_finish(session):
    if any(item.get_closest_marker("cpu_adam") for item in session.items):
        log = Path(tempfile.gettempdir()) / f"cpu_adam_build_{os.getpid()}.log"
        with log.open("w") as out:  # the child keeps its own copy of the descriptor
            _BUILDS.append(
                subprocess.Popen(
                    [sys.executable, "-c", BUILD_CPU_ADAM],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=lambda: os.nice(19),
                )
            )


def pytest_runtest_setup(item):
    """Learner rank actors pooled by tests/rank_pool.py go before a test that does not take them."""
    import rank_pool

    if not rank_pool.takes_ranks_from_the_pool(item):
        rank_pool.drain()


def pytest_sessionfinish(session, exitstatus):
    for build in _BUILDS:
        build.wait()
