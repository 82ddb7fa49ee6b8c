"""Where a ZeRO-3 learner rank's memory goes on CPU, against ZeRO's own accounting (issue 39).

    .venv/bin/python bench/bench_zero_memory.py [--hidden 512] [--layers 12] [--vocab 32768]
        [--samples 8] [--prompt-tokens 64] [--response-tokens 192] [--cases deepspeed-sizes cpu-sizes ...]

A Qwen2-shaped causal LM (random weights, built from a config into a temporary folder) is trained by
two real DeepSpeed learner ranks (`learner.rank.LearnerRank`, ZeRO-3, float32, gloo, one process and
one thread each) for two `train_step`s on the same shard, once per case. Per rank it reports:

  rest       RSS after `setup` (model loaded, engine built) and before the first step;
  after      RSS after the second step (Adam's states exist from the first one);
  peak       the largest RSS during the two steps, over `rest` (the sampler reads it every 5 ms);
  held       what the engine's optimizer object holds, by attribute (every tensor reachable from it
             and from the parameters' ZeRO partitions, each storage counted once): the parameters'
             partitions, the fp32 master partitions, the gradient partitions, Adam's states, the
             gradient reduction buckets; against ZeRO-3's accounting, 16 bytes per parameter split
             over the ranks (weights, gradients, two Adam moments, float32).
and both ranks' PSS together at rest and at their peaks, and step 2's losses and gradient norm (equal
in every case that changes only buffer sizes). Nothing is asserted; the machine should be quiet for
the seconds column (the memory does not depend on it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20

# DeepSpeed's own ZeRO-3 sizes (elements), made for GPUs: 5e8 for reduction and all-gather, 5e7 for
# prefetch, up to 1e9 parameters kept gathered. The learner's config sizes them for CPU ranks on gloo
# (`learner.deepspeed_setup.CPU_ZERO`, `CPU_ZERO3`); the first case puts DeepSpeed's back.
DEEPSPEED_SIZES = {
    "zero_optimization": {
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
    }
}
# What fits the 0.5B step on this 24 GiB machine (the last case; `bench_scale.py --fit` too).
FIT = {"fused_adam": True, "logits_chunk_tokens": 256, "gradient_checkpointing": True}
CASES: dict[str, dict] = {
    "deepspeed-sizes": {"deepspeed_overrides": DEEPSPEED_SIZES},
    "cpu-sizes": {},
    "cpu-sizes+chunked-logits": {"logits_chunk_tokens": 256},
    "cpu-sizes+chunked+checkpointing": {"logits_chunk_tokens": 256, "gradient_checkpointing": True},
    "cpu-sizes+fused-adam": {"fused_adam": True},
    "cpu-sizes+fused+chunked+checkpointing": FIT,
}


def _tensors_of(obj, seen_objs: set[int], depth: int = 0):
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts (bounded depth)."""
    import torch

    if depth > 4 or id(obj) in seen_objs:
        return
    seen_objs.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v, seen_objs, depth + 1)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors_of(v, seen_objs, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and depth < 2:
        for v in vars(obj).values():
            yield from _tensors_of(v, seen_objs, depth + 1)


def held_by_optimizer(engine) -> dict[str, float]:
    """MiB of tensor storage reachable from each attribute of the ZeRO optimizer (storages counted once,
    in attribute order), plus the parameters' own partitions (`ds_tensor`)."""
    opt = engine.optimizer
    seen_storage: set[int] = set()
    out: dict[str, float] = {}

    def add(name: str, tensors) -> None:
        total = 0
        for t in tensors:
            try:
                s = t.untyped_storage()
            except Exception:  # noqa: BLE001 - a tensor without storage (meta)
                continue
            if s.data_ptr() == 0 or s.data_ptr() in seen_storage:
                continue
            seen_storage.add(s.data_ptr())
            total += s.nbytes()
        if total:
            out[name] = out.get(name, 0.0) + total / MIB

    params = list(engine.module.parameters())
    add("param partitions (ds_tensor)", [p.ds_tensor for p in params if hasattr(p, "ds_tensor")])
    add("params (full data held)", [p.data for p in params])
    add("adam states", _tensors_of(getattr(opt, "optimizer", opt).state, set()))
    for name, value in vars(opt).items():
        add(name, _tensors_of(value, set()))
    return out


def _rank_main(rank: int, port: int, policy: str, fields: dict, shard, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    log = os.open(Path(policy) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(1, str(ROOT / "bench"))
    import psutil
    import torch.distributed as dist
    from bench_export import PeakRSS

    from learner.config import LearnerConfig
    from learner.rank import LearnerRank
    from learner.trajectory import Trajectory

    proc = psutil.Process()
    shard = [Trajectory(*f) for f in shard]
    config = LearnerConfig(dist_timeout_s=3600, ppo_epochs=1, micro_batch_size=2, **fields)
    sampler = PeakRSS()
    base = sampler.rss()
    learner = LearnerRank(rank, 2, policy, config, temperature=1.0)
    learner.setup("127.0.0.1", port)
    setup_peak = max(sampler.peak, sampler.rss()) - base
    try:
        dist.barrier()
        rest, rest_pss = sampler.rss(), proc.memory_full_info().pss
        sampler.reset()
        seconds, metrics = [], {}
        for _ in range(2):
            t0 = time.perf_counter()
            metrics = learner.train_step(shard)
            seconds.append(time.perf_counter() - t0)
            dist.barrier()
        peak = max(sampler.peak, sampler.rss())
        after = sampler.rss()
        held = held_by_optimizer(learner.engine)
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in learner.engine.module.parameters())
    finally:
        sampler.close()
        learner.shutdown()
    out.put(
        (
            rank,
            {
                "base_mib": base / MIB,
                "setup_peak_mib": setup_peak / MIB,
                "rest_mib": rest / MIB,
                "rest_pss_mib": rest_pss / MIB,
                "after_mib": after / MIB,
                "peak_over_rest_mib": (peak - rest) / MIB,
                "peak_mib": peak / MIB,
                "seconds": seconds,
                "held_mib": held,
                "params": n_params,
                "metrics": {k: metrics[k] for k in ("loss/policy", "loss/value", "params/grad_norm")},
            },
        )
    )


def run_case(policy: str, fields: dict, shards) -> dict[int, dict]:
    from bench_learner import run_ranks

    return run_ranks(_rank_main, [(policy, fields, shards[r]) for r in range(2)], policy)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--response-tokens", type=int, default=192)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--zero-stage", type=int, choices=(2, 3), default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors leave RSS (ranks inherit it)
    import numpy as np
    from bench_learner import build_policy

    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        n = build_policy(Path(tmp), args.hidden, args.layers, args.vocab)
        P, R = args.prompt_tokens, args.response_tokens
        trajs = [
            (
                rng.integers(2, args.vocab, size=P),
                rng.integers(2, args.vocab, size=R),
                rng.normal(-10.0, 0.5, R).astype(np.float32),
                rng.normal(-10.0, 0.5, R).astype(np.float32),
                float(rng.normal()),
            )
            for _ in range(args.samples)
        ]
        shards = [trajs[0::2], trajs[1::2]]
        zero_mib = 16 * n / 2 / MIB
        print(
            f"Qwen2-shaped model: {n / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab "
            f"{args.vocab}), float32, 2 ZeRO-{args.zero_stage} ranks (gloo, 1 thread each), {args.samples} x {P + R} tokens "
            f"per step ({args.samples // 2} per rank); ZeRO-3's accounting: {zero_mib:.0f} MiB per rank "
            "(16 bytes per parameter over 2 ranks)"
        )
        for case in args.cases:
            res = run_case(tmp, {"zero_stage": args.zero_stage, **CASES[case]}, shards)
            row = {"case": case, "params": n, "ranks": res}
            rows.append(row)
            r0, r1 = res[0], res[1]
            print(f"\n## {case}")
            print(
                f"rank 0 / 1: rest {r0['rest_mib']:.0f} / {r1['rest_mib']:.0f} MiB (process base "
                f"{r0['base_mib']:.0f}), after 2 steps {r0['after_mib']:.0f} / {r1['after_mib']:.0f}, "
                f"peak over rest {r0['peak_over_rest_mib']:.0f} / {r1['peak_over_rest_mib']:.0f}, setup peak "
                f"over base {r0['setup_peak_mib']:.0f} / {r1['setup_peak_mib']:.0f}; step seconds "
                f"{', '.join(f'{s:.1f}' for s in r0['seconds'])}; PSS at rest both ranks "
                f"{(r0['rest_pss_mib'] + r1['rest_pss_mib']) / 1024:.2f} GiB; peaks together "
                f"{(r0['peak_mib'] + r1['peak_mib']) / 1024:.2f} GiB"
            )
            m = r0["metrics"]
            print("step 2: " + ", ".join(f"{k} {v!r}" for k, v in m.items()))
            print("| held by rank 0's ZeRO optimizer | MiB |\n|---|---:|")
            for name, mib in sorted(r0["held_mib"].items(), key=lambda kv: -kv[1]):
                if mib >= 1:
                    print(f"| {name} | {mib:.0f} |")
            print(f"| total | {sum(r0['held_mib'].values()):.0f} |")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
