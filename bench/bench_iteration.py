"""Benchmark one PPO iteration of the demo: time per phase, throughput, peak memory per actor.

    .venv/bin/python bench/bench_iteration.py [--steps 20] [--set learner.num_ranks=2 ...]

Prints a table; nothing is asserted. Peak memory is each actor process's max RSS.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from cluster.config.schema import load_config  # noqa: E402
from cluster.pipeline.run import Run  # noqa: E402
from cluster.train import init_ray, preflight  # noqa: E402

PHASES = ["time/generate", "time/score", "time/train", "time/weight_sync", "time/step"]


def _peak_rss_mb(_self=None) -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/sentiment_tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    overrides = [
        f"run.steps={args.steps}",
        "run.progress_bar=false",
        "run.sample_log_count=0",
        "eval.prompts_path=null",  # no held-out evaluation inside the timed steps
        "run.loggers=[jsonl,prometheus]",
        "cluster.dashboard=false",
        *args.overrides,
    ]
    cfg = load_config(args.config, overrides)
    preflight(cfg)
    t_start = time.perf_counter()
    init_ray(cfg)
    trainer = Run(cfg, Path(tempfile.mkdtemp(prefix="bench-")))
    try:
        t_ready = time.perf_counter() - t_start
        while trainer.step < cfg.run.steps:
            trainer.iteration()
        roles = trainer.roles
        named = [(m.name, m.handle) for pool in roles.pools() for m in pool.members]
        named += [(f"learner-rank-{i}", a) for i, a in enumerate(roles.ranks)]
        peaks = {n: ray.get(a.__ray_call__.remote(_peak_rss_mb), timeout=60) for n, a in named}
    finally:
        trainer.close()

    hist = trainer.progress.history[args.warmup :] or trainer.progress.history
    print(f"\nbenchmark: {args.config} {' '.join(args.overrides)}")
    print(f"steps measured: {len(hist)} (after {args.warmup} warm-up), start-up {t_ready:.1f}s")
    print(f"{'phase':<22}{'median s':>10}{'mean s':>10}{'share':>8}")
    step_med = statistics.median(m["time/step"] for m in hist)
    for k in PHASES:
        vals = [m[k] for m in hist]
        print(
            f"{k:<22}{statistics.median(vals):>10.3f}{statistics.mean(vals):>10.3f}{statistics.median(vals) / step_med:>8.0%}"
        )
    for k in ["throughput/tokens_per_s", "throughput/samples_per_s"]:
        print(f"{k:<22}{statistics.median(m[k] for m in hist):>10.1f}")
    print(f"{'actor':<22}{'peak RSS MB':>12}")
    for n, mb in peaks.items():
        print(f"{n:<22}{mb:>12.0f}")
    print(f"{'driver':<22}{_peak_rss_mb():>12.0f}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
