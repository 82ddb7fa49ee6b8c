"""Config overrides that point the demo config at the test session's assets, small and quiet."""

from __future__ import annotations

from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sentiment_tiny.yaml"

# Steps of 8 prompts in chunks of 4 (the demo's are 64 in chunks of 32): for the tests that check how a
# run behaves (faults, stops, versions, metrics), not how much it learns.
SMALL_STEPS = {"data.prompts_per_step": 8, "rollout.chunk_size": 4, "learner.micro_batch_size": 8}
SYNC_DEMO_STEPS = 3  # conftest's `sync_demo_rows`: the sync pipeline's steps other paths are compared with


def demo_overrides(assets, steps: int, **extra) -> list[str]:
    sets = {
        "model.policy_path": assets.policy,
        "model.demo_assets": None,
        "eval.prompts_path": None,  # held-out evaluation off unless a test turns it on
        "data.prompts_path": assets.prompts,
        "reward.model_path": assets.reward,
        "run.steps": steps,
        "run.progress_bar": False,
        "run.sample_log_count": 2,
        "run.loggers": "[jsonl,prometheus]",
        "cluster.dashboard": False,
        "cluster.placement": "separate",  # the tests of scaling, faults and async; test_colocated.py the other
        "rollout.num_cpus_per_worker": 0.5,
        "learner.num_cpus_per_rank": 1.0,
        "learner.torch_threads": 1,  # tests run 2 ranks on 2 cores
        **extra,
    }
    return [f"{k}={'null' if v is None else v}" for k, v in sets.items()]


def train_rows(cfg, run_dir: Path, steps: int) -> list[dict]:
    """Set up a run of `cfg` in `run_dir`, train `steps` steps, close it; the steps' metrics rows."""
    from cluster.pipeline.run import Run

    trainer = Run(cfg, run_dir)
    try:
        return [trainer.iteration() for _ in range(steps)]
    finally:
        trainer.close()


def prompt_file(assets, folder: Path, n: int) -> Path:
    """The first `n` demo prompts as a file of their own (one epoch = n prompts)."""
    rows = assets.prompts.read_text().splitlines()[:n]
    path = Path(folder) / "prompts.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path
