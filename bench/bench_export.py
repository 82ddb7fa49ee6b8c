"""Weight export memory and time: ZeRO-2 vs ZeRO-3, whole-model gather vs bounded buckets, 2 ranks.

    .venv/bin/python bench/bench_export.py [--layers 12] [--hidden 768] [--vocab 32000] [--reps 3]

A GPT-2 built from a config (defaults: 12 layers, 768 wide, 32000 tokens: ~110M parameters, fp32)
is saved to a temporary folder; for each (ZeRO stage, export_bucket_mb) two real DeepSpeed learner
ranks (gloo, one process each, `learner.rank.LearnerRank`) run `export_weights` `--reps` times.
Per rank a sampler thread reads the process's RSS every 5 ms: the table shows RSS before the export,
the extra of the gather alone, the peak during the export (probe forward + gather) and its extra
(peak - before), the largest over reps, and the median seconds per
export. `--bucket-mb` values: the default list holds 1e6 (one bucket = the whole model: how export
worked before bucketing) and 64. Rank 0 keeps the exported bundle (the full model on CPU) by design;
the ZeRO-3 extra on rank 1 is what the buckets bound. Timings need a quiet machine; nothing is asserted.
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

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from machine import PeakRSS  # noqa: E402

MB = 2**20


def _rank_main(rank: int, world: int, port: int, policy: str, stage: int, bucket_mb: float, reps: int, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    from learner.config import LearnerConfig
    from learner.gather import cpu_state_dict
    from learner.rank import LearnerRank

    config = LearnerConfig(zero_stage=stage, export_bucket_mb=bucket_mb, dist_timeout_s=1800)
    learner = LearnerRank(rank, world, policy, config)
    learner.setup("127.0.0.1", port)
    sampler = PeakRSS()
    rows = []

    def measured(fn):
        dist.barrier()
        before = sampler.rss()
        sampler.reset()
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        return result, (before, max(sampler.peak, sampler.rss()), seconds)

    try:
        for _ in range(reps):
            # The gather alone (what the buckets bound), then the whole export (probe forward + gather).
            state = learner.engine.module.policy.state_dict(keep_vars=True)
            bundle, gather = measured(
                lambda s=state: cpu_state_dict(s, learner._bucket_bytes, keep=rank == 0)
            )
            del bundle, state
            bundle, export = measured(learner.export_weights)
            del bundle
            rows.append((gather, export))
    finally:
        sampler.close()
        learner.shutdown()
    out.put((rank, rows))


def run_case(policy: str, stage: int, bucket_mb: float, reps: int, world: int = 2) -> list[tuple]:
    from learner.deepspeed_setup import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, policy, stage, bucket_mb, reps, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    return [(r, *_summary(results[r])) for r in range(world)]


def _summary(rows: list[tuple]) -> tuple:
    gather = max(p - b for (b, p, _), _ in rows)
    before = max(b for _, (b, _, _) in rows)
    peak = max(p for _, (_, p, _) in rows)
    extra = max(p - b for _, (b, p, _) in rows)
    return before / MB, gather / MB, peak / MB, extra / MB, statistics.median(s for _, (_, _, s) in rows)


def build_policy(folder: Path, layers: int, hidden: int, vocab: int) -> int:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab, n_positions=1024, n_embd=hidden, n_layer=layers, n_head=max(1, hidden // 64)
    )
    model = GPT2LMHeadModel(cfg)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[1e6, 64.0])
    args = ap.parse_args()
    torch.set_num_threads(1)
    # A fixed mmap threshold turns off glibc's growing one, so freed tensors leave RSS (the ranks inherit it).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    with tempfile.TemporaryDirectory() as tmp:
        n = build_policy(Path(tmp), args.layers, args.hidden, args.vocab)
        print(f"GPT-2 from config: {n / 1e6:.1f}M parameters, {n * 4 / MB:.0f} MiB in fp32; 2 ranks, gloo")
        print(
            f"{'zero':>4} {'bucket_mb':>9} {'rank':>4} {'rss_before_MiB':>14} {'gather_extra_MiB':>16} "
            f"{'export_peak_MiB':>15} {'export_extra_MiB':>16} {'s/export':>8}"
        )
        for stage in args.stages:
            for bucket in args.bucket_mb:
                for rank, before, gather, peak, extra, sec in run_case(tmp, stage, bucket, args.reps):
                    label = "whole" if bucket >= 1e5 else f"{bucket:g}"
                    print(
                        f"{stage:>4} {label:>9} {rank:>4} {before:>14.0f} {gather:>16.0f} {peak:>15.0f} {extra:>16.0f} "
                        f"{sec:>8.2f}"
                    )
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
