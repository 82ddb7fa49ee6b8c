"""Markdown tables of `bench_scale.py`'s rows for one model size (printed after each size)."""

from __future__ import annotations

import sys

# `SyncResult.stages` of a push, in the order the push runs them (object store: the learner's stages,
# then the worker's; collective: the worker receives and loads while rank 0 sends)
STAGES = [
    ("learner_probe_s", "learner probe"),
    ("learner_gather_s", "learner gather+cast"),
    ("learner_describe_s", "learner checksum+digest"),
    ("learner_send_s", "learner send"),
    ("worker_load_s", "worker receive+load"),
    ("worker_checksum_s", "worker checksum"),
    ("worker_digest_s", "worker digests"),
    ("worker_probe_s", "worker probe"),
]


def _probe(row: dict) -> str:
    probe = "every push" if row.get("probe", True) else "digests only"
    return f"{probe}, {row['lora_sync']}" if row.get("lora_sync") else probe


def print_size(name: str, facts: dict, rows: list[dict], args) -> None:
    mine = [r for r in rows if r["size"] == name]
    nbytes = facts["bundle_bytes"][args.dtype]
    print(
        f"\n### {name}: {facts['params'] / 1e6:.1f}M parameters, bundle {nbytes / 1e6:.1f} MB at {args.dtype}"
    )
    copies = [
        f"{r['gb_per_s']:.2f} GB/s with {r['threads']} thread(s)" for r in mine if r["kind"] == "memcpy"
    ]
    print(f"\nmemcpy: {', '.join(copies)}")
    learner = [r for r in mine if r["kind"] == "learner"]
    if learner:
        print("\n| learner rank | sequences x tokens | step s | RSS at rest MiB | step peak over rest MiB |")
        print("|---:|---:|---:|---:|---:|")
        for r in learner:
            print(
                f"| {r['rank']} | {r['sequences']} x {r['tokens'] // r['sequences']} | {r['step_s']:.2f} | "
                f"{r['rest_rss_mib']:.0f} | {r['step_peak_over_rest_mib']:.0f} |"
            )
    pushes = [r for r in mine if r["kind"] == "push"]
    if pushes:
        print(
            f"\n| path | engine | probe | MB moved | s (median of {args.reps}) | first s | GB/s | of memcpy | "
            "worker peak over before MiB | learner r0 peak over rest MiB |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in pushes:
            if "error" in r:
                print(
                    f"| {r['path']} | {r['engine']} | {_probe(r)} | {r['bytes'] / 1e6:.1f} | FAILED: {r['error'][:120]} |||||"
                )
                continue
            print(
                f"| {r['path']} | {r['engine']} | {_probe(r)} | {r['bytes'] / 1e6:.2f} | {r['seconds']:.3f} | {r['first_s']:.3f} | "
                f"{r['gb_per_s']:.3f} | {r['memcpy_fraction']:.1%} | {r['worker_peak_over_before_mib']:.0f} | "
                f"{r['learner0_peak_over_rest_mib']:.0f} |"
            )
    timed = [r for r in pushes if "stages" in r]
    if timed:
        print(
            f"\nWhere the push went (seconds, median of {args.reps}; a stage a path does not run is blank):\n"
        )
        print("| path | engine | probe | " + " | ".join(label for _k, label in STAGES) + " | total |")
        print("|---|---|---|" + "---:|" * (len(STAGES) + 1))
        for r in timed:
            cells = [f"{r['stages'][k]:.2f}" if k in r["stages"] else "" for k, _label in STAGES]
            print(
                f"| {r['path']} | {r['engine']} | {_probe(r)} | "
                + " | ".join(cells)
                + f" | {r['seconds']:.2f} |"
            )
    for r in mine:
        if r["kind"] == "error":
            print(f"\nsize FAILED: {r['error']}")
        elif r["kind"] == "driver":
            starts = ", ".join(f"{k} {v:.0f} s" for k, v in r["start_s"].items())
            print(
                f"\ndriver peak RSS {r['peak_rss_mib']:.0f} MiB ({r['peak_over_start_mib']:+.0f} MiB over its RSS at "
                f"the size's start); process tree (driver, Ray, actors) peak PSS {r['tree_peak_pss_mib'] / 1024:.2f} "
                f"GiB; other processes used {r['foreign_cpu_frac']:.0%} of the CPUs; start-up: {starts}; "
                f"{r['wall_s']:.0f} s in all"
            )
    sys.stdout.flush()
