"""Sync vs async on the demo, side by side in one run, and a projection past this machine.

    .venv/bin/python bench/bench_async.py [--steps 40] [--set k=v ...]   (make bench-async)

Both sides train the same config and seed, one after the other, on an idle machine (the harness
waits for one). Printed per side: wall time, samples/s, time to P(positive) >= 0.9, final
P(positive) and KL, learner and generator idle fractions, mean staleness. Then a discrete-event
simulation fed with the per-phase costs measured in the sync run projects both modes to 1..64
rollout workers and to longer generations (reasoning-length responses). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
from machine import machine_busy_s  # noqa: E402

from cluster.config.schema import load_config  # noqa: E402
from cluster.pipeline.run import Run  # noqa: E402
from cluster.train import init_ray, preflight  # noqa: E402


def wait_for_idle(max_wait_s: float = 120.0, busy_frac: float = 0.25) -> None:
    """Wait until the machine's other work uses under `busy_frac` of one core for 3 s."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        b0 = machine_busy_s()
        time.sleep(3.0)
        if (machine_busy_s() - b0) / 3.0 < busy_frac:
            return
    print(f"[bench-async] machine still busy after {max_wait_s:.0f}s; measuring anyway", file=sys.stderr)


def measured_overrides(steps: int) -> list[str]:
    """What every timed side sets: `steps` measured after one warm-up step, and nothing else inside them
    (no progress bar, sample log, held-out evaluation, TensorBoard or dashboard)."""
    return [
        f"run.steps={steps + 1}",
        "run.progress_bar=false",
        "run.sample_log_count=0",
        "eval.prompts_path=null",
        "run.loggers=[jsonl,prometheus]",
        "cluster.dashboard=false",
    ]


def async_overrides(eta: int, learner_threads: int = 1) -> list[str]:
    """What every async side sets. In async mode the learner trains while a worker generates: on a small
    machine one thread each, or they oversubscribe the cores (two threads collapse when another
    process holds a core)."""
    return [
        "pipeline.mode=async",
        f"pipeline.max_staleness={eta}",
        "learner.off_policy=tis",
        f"learner.torch_threads={learner_threads}",
    ]


def sync_costs(cfg, sync_side: dict) -> dict[str, float]:
    """The projection's costs from the sync side's median phases (`cfg` its config): one chunk's
    generation on one worker (g), the scoring tail (s), a learner step (t), a weight push (u)."""
    chunks = math.ceil(cfg.data.prompts_per_step / cfg.rollout.chunk_size)
    ph = sync_side["phases"]
    return {
        "g": ph["time/generate"] / chunks * cfg.rollout.num_workers,
        "s": ph["time/score"],
        "t": ph["time/train"],
        "u": ph["time/weight_sync"],
    }


def print_row(label: str, sides: list[dict], key: str, fmt: str, label_width: int, width: int) -> None:
    """One row of a side-by-side table: `key` of each side in `fmt` ('-' where None)."""
    vals = ["-" if side[key] is None else format(side[key], fmt) for side in sides]
    print(f"{label:<{label_width}}" + "".join(f"{v:>{width}}" for v in vals))


def run_side(config: str, overrides: list[str], steps: int) -> dict:
    cfg = load_config(config, overrides)
    preflight(cfg)
    init_ray(cfg)
    trainer = Run(cfg, Path(tempfile.mkdtemp(prefix=f"bench-{cfg.pipeline.mode}-")))
    try:
        trainer.iteration()  # warm-up step (first forward passes, allocator), not measured
        t0 = time.perf_counter()
        rows, t_hit = [], None
        for _ in range(steps):
            m = trainer.iteration()
            m["wall"] = time.perf_counter() - t0
            rows.append(m)
            if t_hit is None and m.get("rollout/reward_prob_mean", 0.0) >= 0.9:
                t_hit = m["wall"]
        wall = time.perf_counter() - t0
    finally:
        trainer.close()
        ray.shutdown()
    tail = rows[-5:]
    samples = sum(m["rollout/samples"] for m in rows)
    return {
        "mode": cfg.pipeline.mode,
        "wall_s": wall,
        "samples_per_s": samples / wall,
        "t_p09_s": t_hit,
        "final_p": statistics.mean(m.get("rollout/reward_prob_mean", math.nan) for m in tail),
        "final_kl": statistics.mean(m["objective/kl"] for m in tail),
        "learner_idle": statistics.mean(
            m.get("pipeline/learner_idle_frac", _sync_learner_idle(m)) for m in rows
        ),
        "generator_idle": statistics.mean(
            m.get("pipeline/generator_idle_frac", _sync_gen_idle(m)) for m in rows
        ),
        "staleness": statistics.mean(m.get("rollout/staleness_mean", 0.0) for m in rows),
        "phases": {k: statistics.median(m[k] for m in rows) for k in PHASES},
        "rows": rows,
    }


PHASES = ["time/generate", "time/score", "time/train", "time/weight_sync", "time/step"]


def _sync_learner_idle(m: dict) -> float:  # in sync mode the learner waits for generation and scoring
    return (m["time/generate"] + m["time/score"]) / m["time/step"]


def _sync_gen_idle(m: dict) -> float:  # ... and generators wait for scoring, training and the push
    return 1.0 - m["time/generate"] / m["time/step"]


# ------------------------------------------------------------------------------------------------
# Discrete-event projection
# ------------------------------------------------------------------------------------------------


def simulate(
    workers: int, chunks: int, g: float, s: float, t: float, u: float, eta: int, steps: int = 200
) -> float:
    """Learner steps per second of the streaming pipeline with staleness bound `eta` (eta = 0 is sync).

    A batch is `chunks` chunks; a chunk takes `g` on one worker, then `s` of scoring; a learner step
    trains `t`, then publishes weights in `u`. Chunks of batch j may start once version j - eta is
    published (AReaL's admission rule: at version v, (eta + v + 1) batches may have been admitted);
    step j starts when the learner is free and batch j is scored.
    """
    free = [0.0] * workers  # when each worker is next free
    published = [0.0]  # published[v]: time version v was published
    for j in range(steps):
        allowed = published[max(0, j - eta)]
        ready = 0.0
        for _ in range(chunks):
            start = max(heapq.heappop(free), allowed)
            heapq.heappush(free, start + g)
            ready = max(ready, start + g + s)
        published.append(max(published[j], ready) + t + u)
    return steps / published[-1]


def projection(costs: dict, chunks: int, eta: int) -> list[tuple]:
    """Steps/s of both modes as workers grow (the batch is split into at least one chunk per worker,
    as one would configure it) and as generation gets longer (reasoning-length responses)."""
    gen_batch, s, t, u = costs["g"] * chunks, costs["s"], costs["t"], costs["u"]
    out = []
    for gen_scale in (1, 8, 64):  # measured responses; 8x and 64x longer
        for w in (1, 2, 4, 8, 16, 32, 64):
            n = max(chunks, w)
            g = gen_batch * gen_scale / n
            sync = simulate(w, n, g, s, t, u, eta=0)
            asyn = simulate(w, n, g, s, t, u, eta=eta)
            out.append((gen_scale, w, sync, asyn, asyn / sync))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/sentiment_tiny.yaml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eta", type=int, default=1)
    ap.add_argument("--async-learner-threads", type=int, default=1)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=None, help="folder for results.json and projection.png")
    args = ap.parse_args()
    base = [*measured_overrides(args.steps), *args.overrides]
    async_sets = async_overrides(args.eta, args.async_learner_threads)
    sides = []
    for sets in (
        ["pipeline.mode=sync", "cluster.placement=separate"],
        [*async_sets, "cluster.placement=separate"],
    ):
        wait_for_idle()
        sides.append(run_side(args.config, [*base, *sets], args.steps))
    sync, asyn = sides

    print(f"\nbench-async: {args.config}, {args.steps} measured steps per side, eta={args.eta}")
    hdr = f"{'':<26}{'sync':>12}{'async':>12}"
    print(hdr)
    print("-" * len(hdr))

    def row(label: str, key: str, fmt: str) -> None:
        print_row(label, sides, key, fmt, 26, 12)

    row("wall time (s)", "wall_s", ".1f")
    row("samples/s", "samples_per_s", ".1f")
    row("time to P(pos)>=0.9 (s)", "t_p09_s", ".1f")
    row("final P(pos)", "final_p", ".3f")
    row("final KL", "final_kl", ".3f")
    row("learner idle fraction", "learner_idle", ".2f")
    row("generator idle fraction", "generator_idle", ".2f")
    row("mean staleness", "staleness", ".2f")
    print(f"{'speed-up (samples/s)':<26}{'':>12}{asyn['samples_per_s'] / sync['samples_per_s']:>11.2f}x")

    cfg = load_config(args.config, base)
    chunks = math.ceil(cfg.data.prompts_per_step / cfg.rollout.chunk_size)
    costs = sync_costs(cfg, sync)
    print(
        f"\nprojection (discrete-event, costs from the sync run: chunk generate {costs['g'] * 1e3:.0f} ms, "
        f"score tail {costs['s'] * 1e3:.0f} ms, train {costs['t'] * 1e3:.0f} ms, weight push {costs['u'] * 1e3:.0f} ms; "
        f"{chunks} chunks per step, eta={args.eta}); learner steps/s"
    )
    print(f"{'gen cost':>9}{'workers':>9}{'sync':>10}{'async':>10}{'speed-up':>10}")
    proj = projection(costs, chunks, args.eta)
    for gen_scale, w, s_, a_, x in proj:
        print(f"{str(gen_scale) + 'x':>9}{w:>9}{s_:>10.2f}{a_:>10.2f}{x:>9.2f}x")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for side in sides:
            side.pop("rows")
        (out / "results.json").write_text(
            json.dumps({"sides": sides, "costs": costs, "projection": proj}, indent=1)
        )
        from svg_plot import line_chart

        series = {f"generation {gs}x": [(w, x) for g2, w, _s, _a, x in proj if g2 == gs] for gs in (1, 8, 64)}
        plot = line_chart(
            out / "projection.svg",
            series,
            f"async (eta={args.eta}) / sync throughput, projected",
            "rollout workers",
            "speed-up",
        )
        print(f"results: {out / 'results.json'}, plot: {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
