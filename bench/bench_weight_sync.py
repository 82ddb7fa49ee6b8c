"""Weight push per path: object store vs collective broadcast, learner rank 0 -> rollout workers.

    .venv-vllm/bin/python bench/bench_weight_sync.py [--engine vllm] [--workers 1] [--big]

A real local Ray with one DeepSpeed learner rank (ZeRO-2, float32) and `--workers` rollout worker
actors. Each push is export (with the probe and checksum on rank 0) + transfer + load + probe
acknowledgement + verification, timed from the driver; the median of `--reps` pushes is printed
per path. `--big` uses a ~124M-parameter GPT-2 built from a config instead of the demo policy.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from cluster.weight_sync import CollectiveWeightSync, push_weights  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.rank import LearnerRank  # noqa: E402
from rollout_workers.config import RolloutConfig  # noqa: E402
from rollout_workers.worker import RolloutWorker  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="hf")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        policy = str(ROOT / "assets" / "sentiment_tiny" / "policy")
        if args.big:
            from bench_engines import _big_policy

            policy = _big_policy(Path(tmp) / "gpt2-124m")
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
        rank = (
            ray.remote(LearnerRank).options(num_cpus=1).remote(0, 1, policy, LearnerConfig(torch_threads=1))
        )
        ray.get(rank.setup.remote(*ray.get(rank.node_address.remote())))
        cfg = RolloutConfig(engine=args.engine)
        workers = [
            ray.remote(RolloutWorker).options(num_cpus=0.5).remote(policy, cfg) for _ in range(args.workers)
        ]
        names = [f"w{i}" for i in range(args.workers)]
        ray.get([w.ping.remote() for w in workers])
        collective = CollectiveWeightSync(args.bucket_mb)
        times: dict[str, list[float]] = {"object_store": [], "collective": []}
        version = 0
        for _ in range(args.reps + 1):  # the first of each is a warm-up (and forms the group)
            for path in times:
                version += 1
                t0 = time.perf_counter()
                if path == "object_store":
                    push_weights([rank], workers, names, version, "float32", 600)
                else:
                    collective.push([rank], workers, names, version, "float32", 600)
                times[path].append(time.perf_counter() - t0)
        model = "gpt2-124M" if args.big else "demo"
        for path, ts in times.items():
            print(
                f"{model:10} {args.engine:5} workers={args.workers} {path:13} "
                f"median {statistics.median(ts[1:]):.3f} s (first {ts[0]:.3f} s)"
            )
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
