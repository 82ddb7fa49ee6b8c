"""Partial rollouts on a long-tail workload: sync vs async vs async + partial rollouts, side by side in
one run, and a projection to 64 workers.

    .venv/bin/python bench/bench_partial.py [--steps 20] [--set k=v ...]   (part of make bench-async)

The workload (`bench/longtail_env.py`): the sentiment demo's prompts as multi-turn episodes of k turns,
k drawn per prompt with P(k) ~ 1/k^2 on 1..8, so the longest episode is ~8x the median (1 turn);
each chunk takes as long as its longest episode. Both async sides publish weights by broadcast
(`rollout.weight_sync: collective`, the GPU cluster's path), where a new version needs every worker at
once: without partial rollouts the workers finish their chunks in flight first (the long tail holds
everyone), with them the broadcast cuts in. Each side is measured on an idle machine (the harness
waits for one). Printed per side: samples/s, generator and learner idle fractions, mean and max
staleness (a sample's oldest token), the mean lag of a trained token, the share of responses that
span two versions, final P(positive). Then `async_sim` projects the three policies (and the
object-store path, which swaps weights between chunks) to 1..64 workers from costs measured in the
sync run. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from async_sim import longtail_lengths, projection  # noqa: E402
from bench_async import (  # noqa: E402
    async_overrides,
    measured_overrides,
    print_row,
    run_side,
    sync_costs,
    wait_for_idle,
)

from cluster.config.schema import load_config  # noqa: E402

LONGEST, TURN_TOKENS = 8, 4
ENV = [
    "rollout.environment.name=longtail",
    f"rollout.environment.module={Path(__file__).resolve().parent / 'longtail_env.py'}",
    f"rollout.environment.kwargs={{longest: {LONGEST}}}",
    f"rollout.environment.max_turns={LONGEST}",
    f"rollout.environment.turn_max_new_tokens={TURN_TOKENS}",
    "rollout.environment.max_total_tokens=64",
]


def side_summary(side: dict) -> dict:
    rows = side["rows"]
    return {
        **{
            k: side[k]
            for k in (
                "mode",
                "wall_s",
                "samples_per_s",
                "final_p",
                "learner_idle",
                "generator_idle",
                "staleness",
            )
        },
        "staleness_max": max(m.get("staleness/max", 0.0) for m in rows),
        "token_lag": statistics.mean(m.get("staleness/token_lag_mean", 0.0) for m in rows),
        "interrupted": statistics.mean(m.get("staleness/interrupted_frac", 0.0) for m in rows),
        "response_tokens": statistics.mean(m["rollout/response_length"] for m in rows),
        "phases": side["phases"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/sentiment_tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=None, help="folder for partial.json")
    args = ap.parse_args()
    base = [
        *measured_overrides(args.steps),
        "cluster.placement=separate",
        "data.prompts_per_step=32",
        "rollout.chunk_size=4",
        f"rollout.num_workers={args.workers}",
        "rollout.num_cpus_per_worker=0.25",
        "learner.micro_batch_size=32",
        *ENV,
        *args.overrides,
    ]
    stream = [*async_overrides(args.eta), "rollout.weight_sync=collective"]
    named = [
        ("sync", ["pipeline.mode=sync"]),
        ("async", stream),
        ("async+partial", [*stream, "pipeline.partial_rollout=true"]),
    ]
    sides = []
    for _name, sets in named:
        wait_for_idle()
        sides.append(side_summary(run_side(args.config, [*base, *sets], args.steps)))

    names = [n for n, _ in named]
    print(
        f"\nbench-async, long-tail workload: {args.config}, {args.steps} measured steps per side, eta={args.eta},"
    )
    print(f"{args.workers} workers, episodes of 1..{LONGEST} turns (P(k) ~ 1/k^2), collective weight sync")
    hdr = f"{'':<30}" + "".join(f"{n:>15}" for n in names)
    print(hdr)
    print("-" * len(hdr))

    def row(label: str, key: str, fmt: str) -> None:
        print_row(label, sides, key, fmt, 30, 15)

    row("samples/s", "samples_per_s", ".1f")
    row("wall time (s)", "wall_s", ".1f")
    row("generator idle fraction", "generator_idle", ".2f")
    row("learner idle fraction", "learner_idle", ".2f")
    row("mean staleness (oldest token)", "staleness", ".2f")
    row("max staleness", "staleness_max", ".0f")
    row("mean token lag", "token_lag", ".2f")
    row("responses spanning versions", "interrupted", ".2f")
    row("response tokens", "response_tokens", ".1f")
    row("final P(positive)", "final_p", ".3f")
    a, p = sides[1]["samples_per_s"], sides[2]["samples_per_s"]
    print(f"{'partial / async (samples/s)':<30}{p / a:>44.2f}x")

    # projection: a chunk takes (cost of one turn) x (its longest episode's turns)
    cfg = load_config(args.config, [*base, "pipeline.mode=sync"])
    chunk_prompts = cfg.rollout.chunk_size * cfg.rollout.sampling.n
    costs = sync_costs(cfg, sides[0])
    rng = random.Random(0)
    mean_longest = statistics.mean(max(longtail_lengths(rng, chunk_prompts, LONGEST)) for _ in range(2000))
    g_turn, s, t, u = costs["g"] / mean_longest, costs["s"], costs["t"], costs["u"]
    r = g_turn / TURN_TOKENS  # recomputing a chunk's KV cache: about one token's decode step of its batch
    print(
        f"\nprojection (discrete-event, costs from the sync run: one turn of a chunk {g_turn * 1e3:.0f} ms, "
        f"score {s * 1e3:.0f} ms, train {t * 1e3:.0f} ms, weight push {u * 1e3:.0f} ms, recompute "
        f"{r * 1e3:.0f} ms; one chunk of {chunk_prompts} episodes per worker per step, eta={args.eta})"
    )
    print(
        f"{'gen':>5}{'workers':>8}{'policy':>10}{'steps/s':>10}{'gen idle':>10}{'token lag':>11}{'vs async':>10}"
    )
    proj = projection(g_turn, s, t, u, r, args.eta, chunk_prompts, longest=LONGEST)
    drain = {(g, w): res.steps_per_s for g, w, pol, res in proj if pol == "drain"}
    for g, w, pol, res in proj:
        if w in (1, 8, 64):
            print(
                f"{str(g) + 'x':>5}{w:>8}{pol:>10}{res.steps_per_s:>10.3f}{res.generator_idle:>10.2f}"
                f"{res.token_lag:>11.2f}{res.steps_per_s / drain[g, w]:>9.2f}x"
            )
    print("(gen: generation cost, 1x as measured, 64x reasoning-length turns; policies: sync; between =")
    print(" object store, loads between chunks; drain = collective without partial rollouts; partial =")
    print(" collective with them. 'vs async' is against drain; all workers, in partial.json.)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "partial.json").write_text(
            json.dumps(
                {
                    "sides": dict(zip(names, sides, strict=True)),
                    "projection": [(g, w, pol, vars(res)) for g, w, pol, res in proj],
                },
                indent=1,
            )
        )
        print(f"results: {out / 'partial.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
