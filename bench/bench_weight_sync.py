"""Weight push per path: object store vs collective broadcast vs the collective path through shared
memory (`rollout.weight_transport`), learner rank 0 -> rollout workers.

    .venv-vllm/bin/python bench/bench_weight_sync.py [--engine vllm] [--workers 1] [--big] [--dtype bfloat16]

A real local Ray with one DeepSpeed learner rank (ZeRO-2, float32) and `--workers` rollout worker
actors (rollout dtype `--dtype`). Each push is export (with the probe, checksum and digest on rank 0)
+ transfer + load + acknowledgement + verification, timed from the driver; the median of `--reps`
pushes is printed per path, with the bundle's bytes at the rollout dtype, GB/s, and rollout worker 0's
peak RSS during the push over its RSS before it (sampled every 5 ms from the driver). `--big` uses a
~124M-parameter GPT-2 built from a config instead of the demo policy. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
from machine import PeakRSS  # noqa: E402

from cluster.weights.collective import CollectiveWeightSync  # noqa: E402
from cluster.weights.push import push_weights  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.rank import LearnerRank  # noqa: E402
from rollout_workers.config import RolloutConfig  # noqa: E402
from rollout_workers.worker import RolloutWorker  # noqa: E402


def bundle_bytes(policy: str, dtype: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(policy))
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return sum(t.numel() * size for t in model.state_dict().values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="hf")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--paths",
        nargs="+",
        default=["object_store", "collective", "shared_memory"],
        choices=["object_store", "collective", "shared_memory"],
        help="collective: broadcast over gloo; shared_memory: the collective path through a shared segment",
    )
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
        cfg = RolloutConfig(engine=args.engine, dtype=args.dtype)
        workers = [
            ray.remote(RolloutWorker).options(num_cpus=0.5).remote(policy, cfg) for _ in range(args.workers)
        ]
        names = [f"w{i}" for i in range(args.workers)]
        ray.get([w.ping.remote() for w in workers])
        sampler = PeakRSS(ray.get(workers[0].__ray_call__.remote(lambda _w: os.getpid())))
        nbytes = bundle_bytes(policy, args.dtype)
        times: dict[str, list[float]] = {p: [] for p in args.paths}
        extra: dict[str, list[float]] = {p: [] for p in args.paths}
        version = 0
        for path in times:  # one path at a time: each collective transport forms its own group
            transport = {"collective": "broadcast", "shared_memory": "shared_memory"}.get(path)
            collective = (
                None if transport is None else CollectiveWeightSync(args.bucket_mb, transport=transport)
            )
            for _ in range(args.reps + 1):  # the first is a warm-up (and forms the group)
                version += 1
                sampler.reset()
                t0 = time.perf_counter()
                if collective is None:
                    push_weights([rank], workers, names, version, args.dtype, 600)
                else:
                    collective.push([rank], workers, names, version, args.dtype, 600)
                times[path].append(time.perf_counter() - t0)
                extra[path].append(sampler.extra())
        sampler.close()
        model = "gpt2-124M" if args.big else "demo"
        print(f"bundle at {args.dtype}: {nbytes / 2**20:.0f} MiB")
        for path, ts in times.items():
            sec = statistics.median(ts[1:])
            print(
                f"{model:10} {args.engine:5} {args.dtype:9} workers={args.workers} {path:13} "
                f"median {sec:.3f} s (first {ts[0]:.3f} s) {nbytes / sec / 1e9:.3f} GB/s, "
                f"worker peak extra {max(extra[path][1:]) / 2**20:.0f} MiB"
            )
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
