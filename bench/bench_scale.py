"""Learner memory and the weight push at model scale: Qwen2-0.5B's shape, GPT-2 124M and a Qwen2-shaped
model ~6.6x smaller than 0.5B, in one run (one process, one local Ray).

    .venv-vllm/bin/python bench/bench_scale.py [--sizes qwen2-75m gpt2-124m qwen2-0.5b] [--dtype bfloat16]
        [--reps 3] [--smoke] [--serial-engines] [--out runs/bench-scale/results.json]

Models are built from configs with random weights (float32; the tests' word-level tokenizer and its
special ids, tests/tiny_models.py: nothing is downloaded) into `--models` (runs/bench-scale/models), once; reruns
reuse them. A build runs in a Ray task of its own, so its memory never shows in the driver.

Per size, with fresh actors (all killed before the next size, so memory does not add up):
  learner  2 `LearnerRank` actors (ZeRO-3, float32, gloo on CPU; LoRA adapters with `--lora-rank`) run one `train_step` on `--samples`
           trajectories of `--prompt-tokens` + `--response-tokens` (half per rank). RSS at rest (before
           the step) and the step's peak over it, per rank.
  push     learner rank 0 -> one `RolloutWorker` at a time (hf, then vLLM with its CPU defaults; rollout
           dtype `--dtype`), over the object store (`push_weights`) and the collective broadcast
           (`CollectiveWeightSync`). One warm-up push (which also forms the broadcast group), then
           `--reps` pushes: seconds is the median `SyncResult.seconds` (export with the digest, and the
           probe on rank 0 in `--probe on` rows -> transfer -> load -> acknowledged and verified, by
           digests alone in `--probe off` rows, a version off `rollout.probe_every`'s cadence); bytes are the bundle at the rollout
           dtype (unique tensors: tied weights once; the adapter's with `--lora-sync adapter`); GB/s = bytes / seconds; memcpy = that over this
           machine's copy bandwidth at the actors' thread count. Peak RSS over the RSS before the push of
           the worker and of learner rank 0: the largest over the timed pushes.
  driver   this process's peak RSS over the size (and over its RSS when the size started), the peak PSS
           of the whole process tree (driver + Ray + actors), and the share of the CPUs other processes
           used meanwhile (on a shared machine, timings with a large share are unreliable).
Every RSS is sampled from the driver every 5 ms (psutil). The memory-copy bandwidth is measured before
each size (after the idle wait; the machine is shared, so it moves) in a Ray task of its own: torch
`copy_` between two `--memcpy-mib` buffers, median of 5, with the actors' thread count and with all
cores. Prints markdown tables per size and writes every row as JSON to `--out` (after each size).
Nothing is asserted.

`--smoke` builds tiny models (~1.7M parameters) and measures less; `--serial-engines` starts each
rollout worker only for its own rows (for a machine where the learner and both engines do not fit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# The sizes and their builds (scale_models.py), one size's actors and measurements (scale_size.py),
# its tables (scale_report.py); this file: the command line, the machine facts, the loop over sizes.
from scale_models import DTYPE_BYTES, FULL, SIZES, SMOKE, cached_model  # noqa: E402
from scale_size import MIB, Size  # noqa: E402

# Pinned before torch (imported with the learner's classes) reads them; the actors get them through
# the job's runtime env, and set their torch threads from the configs.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

ENGINES = ("hf", "vllm")
PATHS = ("object_store", "collective", "shared_memory")
FULL_DEFAULTS = {"reps": 3, "samples": 8, "prompt_tokens": 64, "response_tokens": 192, "memcpy_mib": 1024}
SMOKE_DEFAULTS = {"reps": 2, "samples": 4, "prompt_tokens": 16, "response_tokens": 48, "memcpy_mib": 256}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=None, help=f"default {FULL} ({SMOKE} with --smoke)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny models, fewer/smaller measurements (about a minute)"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_BYTES), help="rollout dtype")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument(
        "--probe",
        nargs="+",
        default=["on", "off"],
        choices=["on", "off"],
        help="pushes that score the probe on both sides (on: every push, rollout.probe_every=1) and pushes "
        "off its cadence (off: digests only); both by default, each its own rows",
    )
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="learner.lora.rank (alpha 2 x rank, all-linear): the learner trains adapters; 0: full fine-tuning",
    )
    ap.add_argument(
        "--lora-sync",
        nargs="+",
        default=["merged"],
        choices=["merged", "adapter"],
        help="with --lora-rank: what pushes carry (rollout.lora_sync), each its own rows; 'adapter' rows take "
        "the object store path only",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed pushes per row (after one warm-up)")
    ap.add_argument("--samples", type=int, default=None, help="trajectories in the learner step (both ranks)")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--response-tokens", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=2, help="learner.micro_batch_size")
    ap.add_argument(
        "--skip-step",
        action="store_true",
        help="no learner step (the pushes only: where the step does not fit)",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="the learner options that fit the 0.5B step on 24 GiB (docs/benchmarks.md, 'Learner memory at "
        "0.5B'): learner.fused_adam, logits_chunk_tokens=256, gradient_checkpointing",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch (and OMP) threads per actor")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="collective broadcast bucket")
    ap.add_argument("--memcpy-mib", type=int, default=None, help="buffer of the memory-copy measurement")
    ap.add_argument(
        "--serial-engines", action="store_true", help="start each rollout worker only for its rows"
    )
    ap.add_argument(
        "--wait-idle", type=float, default=None, help="max seconds to wait for an idle machine per size"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for any one Ray call")
    ap.add_argument("--models", type=Path, default=ROOT / "runs" / "bench-scale" / "models")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-scale" / "results.json")
    args = ap.parse_args()
    for k, v in (SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.sizes = args.sizes or (SMOKE if args.smoke else FULL)
    if not args.lora_rank:
        args.lora_sync = ["merged"]
    if args.wait_idle is None:
        args.wait_idle = 0.0 if args.smoke else 120.0

    threads = str(args.threads)
    for var in THREAD_VARS:
        os.environ[var] = threads
    env = dict.fromkeys(THREAD_VARS, threads)
    env.update(
        TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1"
    )

    import machine
    import ray
    import torch

    # The actors' classes (torch, transformers, DeepSpeed; not vLLM) imported before the first size,
    # so each size's driver growth is its own, not the imports'.
    import cluster.weights.push  # noqa: F401
    import learner.rank  # noqa: F401
    import rollout_workers.worker  # noqa: F401

    torch.set_num_threads(args.threads)
    ray.init(
        address="local",
        num_cpus=8,  # logical: 2 learner ranks (1 each), 2 workers (0.5 each), a task; on any core count
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": env},
    )
    try:
        desc = machine.describe()
        copy = ray.remote(num_cpus=1, max_calls=1)(machine.memcpy_gbps)
        head = {
            **desc,
            "torch_threads_per_actor": args.threads,
            "omp_num_threads": threads,
            "ray": ray.__version__,
            "torch": torch.__version__,
        }
        print(
            f"## bench-scale: {desc['cpu']}, {desc['cores']} cores ({desc['physical_cores']} physical), "
            f"{desc['ram_gib']:.1f} GiB RAM ({desc['available_gib']:.1f} available at start); torch {torch.__version__}, "
            f"ray {ray.__version__}\n"
        )
        print(
            f"torch/OMP threads per actor: {args.threads}. Memory-copy bandwidth per size, just before it (the "
            f"machine is shared: it moves), torch copy_ between two {args.memcpy_mib} MiB buffers, median of 5, "
            f"bytes copied per second; 'of memcpy' is against the {args.threads}-thread figure (as each actor). "
            f"Learner: 2 ranks ZeRO-3 float32 gloo, micro-batch {args.micro_batch}, "
            + (
                f"LoRA rank {args.lora_rank} (alpha {2 * args.lora_rank}, all-linear), "
                if args.lora_rank
                else ""
            )
            + f"one step on {args.samples} x "
            f"({args.prompt_tokens} + {args.response_tokens}) tokens. Push: median of {args.reps} after 1 warm-up, "
            f"rollout dtype {args.dtype}, collective bucket {args.bucket_mb:g} MiB; "
            + ("engines one at a time." if args.serial_engines else "both engines' workers alive throughout.")
        )
        rows: list[dict] = []
        all_facts = {}
        for name in args.sizes:
            policy, facts = cached_model(args.models, name, args.timeout)
            all_facts[name] = facts
            machine.wait_for_idle(args.wait_idle)
            counts = sorted({args.threads, desc["cores"]})
            memcpy = {t: ray.get(copy.remote(args.memcpy_mib * MIB, t), timeout=600) for t in counts}
            rows += [
                {"size": name, "kind": "memcpy", "threads": t, "buffer_mib": args.memcpy_mib, "gb_per_s": g}
                for t, g in memcpy.items()
            ]
            driver = machine.PeakRSS()
            tree = machine.TreeSampler(os.getpid(), 0.5)
            tree.start()
            t0 = time.perf_counter()
            size = Size(name, policy, facts, args, memcpy[args.threads])
            try:
                size.run()
            except Exception as err:  # the size failed; the next one still runs
                error = f"{type(err).__name__}: {str(err)[:500]}"
                size.rows.append({"size": name, "kind": "error", "error": error})
            rows += size.rows
            seen = tree.stop()
            rows.append(
                {
                    "size": name,
                    "kind": "driver",
                    "peak_rss_mib": max(driver.peak, driver.rss()) / MIB,
                    "peak_over_start_mib": driver.extra() / MIB,
                    "tree_peak_pss_mib": seen["peak_pss_mb"],
                    "foreign_cpu_frac": seen["foreign_cpu_frac"],
                    "start_s": size.start_s,
                    "wall_s": time.perf_counter() - t0,
                }
            )
            driver.close()
            from scale_report import print_size

            print_size(name, facts, rows, args)
            args.out.parent.mkdir(parents=True, exist_ok=True)  # after every size: a later failure keeps it
            settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            payload = {"machine": head, "settings": settings, "models": all_facts, "rows": rows}
            args.out.write_text(json.dumps(payload, indent=1))
        print(f"\nrows written to {args.out}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
