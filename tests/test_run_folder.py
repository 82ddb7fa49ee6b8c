"""The run-folder probe on the local Ray: each probe runs in an actor's own process, as it does in
every learner rank at start-up (`Run.setup`, covered end to end by every run test)."""

from __future__ import annotations

import pytest
from demo_run import CONFIG, demo_overrides

from cluster.config.schema import load_config
from cluster.pipeline.control import (
    RunControl,  # a small actor of the run to host the probe (it reads none of it)
)
from cluster.reporting.folder import SharedStorageError, check_ranks_see_run_folder, resolve_paths

pytestmark = pytest.mark.slow


def test_probe_passes_cleans_up_and_names_the_option_when_a_rank_cannot_see(ray_local, demo_assets, tmp_path):
    ray = ray_local
    cfg = resolve_paths(load_config(CONFIG, demo_overrides(demo_assets, 1)))
    hosts = [ray.remote(num_cpus=0)(RunControl).remote({}) for _ in range(2)]
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        check_ranks_see_run_folder(cfg, run_dir, hosts, 120)
        assert list(run_dir.iterdir()) == []  # the probe files are removed

        with pytest.raises(
            SharedStorageError, match=r"^run.output_dir / --run-dir: learner rank 0 .*shared storage"
        ):
            check_ranks_see_run_folder(cfg, tmp_path / "not-there", hosts, 120)

        cfg.model.tokenizer_path = str(tmp_path / "tokenizer")
        with pytest.raises(
            SharedStorageError, match=rf"model.tokenizer_path={tmp_path}/tokenizer .*shared storage"
        ):
            check_ranks_see_run_folder(cfg, run_dir, hosts, 120)
    finally:
        for h in hosts:
            ray.kill(h)
