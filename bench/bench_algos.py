"""Advantage estimators side by side at equal generated samples, on both demos (make bench-algos).

    .venv/bin/python bench/bench_algos.py --demo sentiment  [--steps 30] [--n 4] [--set k=v ...]
    .venv/bin/python bench/bench_algos.py --demo arithmetic [--budget 64000] [--n 8] [--set k=v ...]

sentiment (configs/sentiment_tiny.yaml): gae trains on `data.prompts_per_step` prompts with one sample
each; grpo and rloo on prompts_per_step / n prompts with n samples each, for --steps steps. Measured:
the training reward (classifier logit difference) and P(positive), the final KL, and the samples
each side needed to reach P(positive) >= 0.9.

arithmetic (configs/arithmetic_tiny.yaml, the verifiable-reward demo): gae (one sample per prompt, a
critic), grpo and rloo (n samples per prompt), and grpo + dynamic sampling (the demo's default), each
run until it has generated --budget samples (filtered groups count: they were generated). Measured:
held-out sampled accuracy (eval/accuracy = mean@k over the held-out problems, never trained on),
evaluated every eval.every_steps steps; its final and best value, the generated samples to reach
held-out 0.8, and each side's wall time. Run on an idle machine for the wall times to mean anything.

Written with --out: results.json and one SVG (P(positive), or held-out accuracy, against samples).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402

from cluster.config.schema import load_config  # noqa: E402
from cluster.pipeline.run import Run  # noqa: E402
from cluster.train import init_ray, preflight  # noqa: E402

CONFIGS = {"sentiment": "configs/sentiment_tiny.yaml", "arithmetic": "configs/arithmetic_tiny.yaml"}


@dataclass(frozen=True)
class Side:
    label: str
    overrides: list[str]


def sides(demo: str, samples_per_step: int, n: int) -> list[Side]:
    """The sides of `demo`, each generating `samples_per_step` samples per step before any filtering."""
    if samples_per_step % n:
        raise SystemExit(f"--n {n} must divide the samples per step ({samples_per_step}) for equal samples")
    gae = ["learner.advantage=gae", f"data.prompts_per_step={samples_per_step}", "rollout.sampling.n=1"]
    group = [f"data.prompts_per_step={samples_per_step // n}", f"rollout.sampling.n={n}"]
    if demo == "sentiment":
        return [
            Side("gae", gae),
            Side("grpo", ["learner.advantage=grpo", *group]),
            Side("rloo", ["learner.advantage=rloo", *group]),
        ]
    off = "data.dynamic_sampling.filter=none"
    return [
        Side("gae", [*gae, off]),
        Side("grpo", ["learner.advantage=grpo", *group, off]),
        Side("grpo+dynamic", ["learner.advantage=grpo", *group, "data.dynamic_sampling.filter=nonzero_std"]),
        Side("rloo", ["learner.advantage=rloo", *group, off]),
    ]


def run_side(config: str, overrides: list[str], budget: int | None, held_out: bool) -> dict:
    """Train one side: cfg.run.steps steps, or (with `budget`) until that many samples were generated.
    Rows carry the trained and generated samples so far; with `held_out` the held-out evaluation runs
    before training, every eval.every_steps steps and after the last step."""
    cfg = load_config(config, overrides)
    preflight(cfg)
    init_ray(cfg)  # started by the first side, reused by the others
    n = cfg.rollout.sampling.n
    rows, evals, trained, generated = [], [], 0, 0
    t0 = time.perf_counter()  # wall_s counts the run's set-up (its constructor)
    trainer = Run(cfg, Path(tempfile.mkdtemp(prefix=f"bench-algos-{cfg.learner.advantage}-")))
    try:
        if held_out:
            evals.append({"step": 0, "samples": 0, "generated": 0, **trainer.evaluator.evaluate()[0]})
        step = 0
        while (budget is None and step < cfg.run.steps) or (budget is not None and generated < budget):
            m = trainer.iteration()
            step += 1
            trained += int(m["rollout/samples"])
            generated += int(m["rollout/samples"]) + int(m.get("dynamic/filtered_groups", 0)) * n
            row = {"step": step, "samples": trained, "generated": generated}
            row.update({k: v for k, v in m.items() if isinstance(v, float | int)})
            rows.append(row)
            if held_out and "eval/accuracy" in m:
                evals.append(row)
        if held_out and evals[-1]["step"] != step:
            evals.append(
                {"step": step, "samples": trained, "generated": generated, **trainer.evaluator.evaluate()[0]}
            )
    finally:
        trainer.close()
    return {"rows": rows, "evals": evals, "wall_s": time.perf_counter() - t0}


def sentiment_summary(side: dict) -> dict:
    rows = side["rows"]
    tail = rows[-min(5, len(rows)) :]
    hit = next((r["samples"] for r in rows if r.get("rollout/reward_prob_mean", 0.0) >= 0.9), None)
    return {
        "final_reward": statistics.mean(r["rollout/reward_mean"] for r in tail),
        "final_p": statistics.mean(r.get("rollout/reward_prob_mean", float("nan")) for r in tail),
        "final_kl": statistics.mean(r["objective/kl"] for r in tail),
        "samples_to_p09": hit,
    }


def arithmetic_summary(side: dict) -> dict:
    evals = side["evals"]
    hit = next((e["generated"] for e in evals if e["eval/accuracy"] >= 0.8), None)
    last = evals[-1]
    return {
        "start_accuracy": evals[0]["eval/accuracy"],
        "final_accuracy": last["eval/accuracy"],
        "best_accuracy": max(e["eval/accuracy"] for e in evals),
        "final_pass": {k[5:]: v for k, v in last.items() if k.startswith("eval/pass@")},
        "generated_to_08": hit,
        "steps": side["rows"][-1]["step"],
        "generated": side["rows"][-1]["generated"],
        "trained": side["rows"][-1]["samples"],
        "wall_s": side["wall_s"],
    }


def print_table(title: str, labels: list[str], lines: list[tuple[str, list[object]]]) -> None:
    print(f"\n{title}")
    hdr = f"{'':<32}" + "".join(f"{x:>14}" for x in labels)
    print(hdr)
    print("-" * len(hdr))
    for name, vals in lines:
        print(f"{name:<32}" + "".join(f"{'-' if v is None else v:>14}" for v in vals))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", choices=sorted(CONFIGS), default="sentiment")
    ap.add_argument("--config", default=None, help="default: the demo's config")
    ap.add_argument("--steps", type=int, default=30, help="sentiment: steps per side")
    ap.add_argument(
        "--budget",
        type=int,
        default=None,
        help="arithmetic: generated samples per side "
        "(default: the demo config's run.steps x samples per step)",
    )
    ap.add_argument(
        "--n",
        type=int,
        default=None,
        help="samples per prompt of the group estimators "
        "(default: 4 for sentiment, the config's rollout.sampling.n for arithmetic)",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=None, help="folder for results.json and the SVG plot")
    args = ap.parse_args()
    config = args.config or CONFIGS[args.demo]
    arith = args.demo == "arithmetic"
    base = [
        "run.progress_bar=false",
        "run.sample_log_count=0",
        "run.loggers=[jsonl,prometheus]",
        "cluster.dashboard=false",
    ]
    base += [] if arith else [f"run.steps={args.steps}"]
    base += args.overrides
    cfg = load_config(config, base)
    n = args.n or (cfg.rollout.sampling.n if arith else 4)
    per_step = cfg.data.prompts_per_step * (cfg.rollout.sampling.n if arith else 1)
    budget = (args.budget or cfg.run.steps * per_step) if arith else None
    todo = sides(args.demo, per_step, n)
    try:
        results = {s.label: run_side(config, [*base, *s.overrides], budget, held_out=arith) for s in todo}
    finally:
        ray.shutdown()
    labels = list(results)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)

    if arith:
        stats = {k: arithmetic_summary(v) for k, v in results.items()}
        fmt = lambda key, f: [None if stats[k][key] is None else format(stats[k][key], f) for k in labels]  # noqa: E731
        print_table(
            f"bench-algos arithmetic: {config}, {budget} generated samples per side, {per_step} per step (n={n})",
            labels,
            [
                ("held-out accuracy, start", fmt("start_accuracy", ".3f")),
                ("held-out accuracy, final", fmt("final_accuracy", ".3f")),
                ("held-out accuracy, best", fmt("best_accuracy", ".3f")),
                ("generated samples to 0.8", fmt("generated_to_08", "d")),
                ("steps", fmt("steps", "d")),
                ("samples trained", fmt("trained", "d")),
                ("wall time (s)", fmt("wall_s", ".0f")),
            ],
        )
        series = {k: [(e["generated"], e["eval/accuracy"]) for e in v["evals"]] for k, v in results.items()}
        chart = (
            "held_out_accuracy.svg",
            "arithmetic: held-out sampled accuracy at equal generated samples",
            "generated samples",
            "held-out accuracy",
        )
    else:
        stats = {k: sentiment_summary(v) for k, v in results.items()}
        marks = sorted({1, *range(5, args.steps + 1, 5), args.steps})
        lines = [
            (f"reward, step {s}", [f"{results[k]['rows'][s - 1]['rollout/reward_mean']:.3f}" for k in labels])
            for s in marks
        ]
        fmt = lambda key, f: [None if stats[k][key] is None else format(stats[k][key], f) for k in labels]  # noqa: E731
        lines += [
            ("final reward (last 5)", fmt("final_reward", ".3f")),
            ("final P(positive)", fmt("final_p", ".3f")),
            ("final KL", fmt("final_kl", ".3f")),
            ("samples to P(pos) >= 0.9", fmt("samples_to_p09", "d")),
        ]
        print_table(
            f"bench-algos sentiment: {config}, {args.steps} steps, {per_step} samples per step (grpo/rloo: n={n})",
            labels,
            lines,
        )
        series = {
            k: [(r["samples"], r.get("rollout/reward_prob_mean", 0.0)) for r in v["rows"]]
            for k, v in results.items()
        }
        chart = (
            "reward.svg",
            f"sentiment: P(positive) at equal samples (grpo/rloo n={n})",
            "samples",
            "P(positive)",
        )
    if out:
        from svg_plot import line_chart

        (out / "results.json").write_text(json.dumps({"summary": stats, "sides": results}, indent=1))
        plot = line_chart(out / chart[0], series, chart[1], chart[2], chart[3], log2_x=False)
        print(f"results: {out / 'results.json'}, plot: {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
