"""Advantage estimators side by side on the demo: gae, grpo and rloo at equal samples per step.

    .venv/bin/python bench/bench_algos.py [--steps 30] [--n 4] [--set k=v ...]   (make bench-algos)

gae trains on `data.prompts_per_step` prompts with one sample each; grpo and rloo on
prompts_per_step / n prompts with n samples each, so every side sees the same number of samples
(and response tokens, up to lengths) per step. Same config, seed and KL settings otherwise.
Printed: the reward (classifier logit difference) and P(positive) at a few steps, the final KL,
and the samples each side needed to reach P(positive) >= 0.9. Written with --out: results.json and
reward.svg (P(positive) against samples). Nothing is timed and nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402

from cluster.config import load_config  # noqa: E402
from cluster.streaming import make_trainer  # noqa: E402
from cluster.train import init_ray, preflight  # noqa: E402

ESTIMATORS = ("gae", "grpo", "rloo")


def side_overrides(estimator: str, prompts_per_step: int, n: int) -> list[str]:
    """The settings that make `estimator` see `prompts_per_step` samples per step."""
    if estimator == "gae":
        return ["learner.advantage=gae", f"data.prompts_per_step={prompts_per_step}", "rollout.sampling.n=1"]
    if prompts_per_step % n:
        raise SystemExit(f"--n {n} must divide data.prompts_per_step={prompts_per_step} (equal samples)")
    return [
        f"learner.advantage={estimator}",
        f"data.prompts_per_step={prompts_per_step // n}",
        f"rollout.sampling.n={n}",
    ]


def run_side(config: str, overrides: list[str]) -> list[dict]:
    cfg = load_config(config, overrides)
    preflight(cfg)
    init_ray(cfg)  # started by the first side, reused by the others
    trainer = make_trainer(cfg, Path(tempfile.mkdtemp(prefix=f"bench-algos-{cfg.learner.advantage}-")))
    rows, samples = [], 0
    try:
        trainer.setup()
        for _ in range(cfg.run.steps):
            m = trainer.iteration()
            samples += int(m["rollout/samples"])
            rows.append({"samples": samples, **{k: v for k, v in m.items() if isinstance(v, float | int)}})
    finally:
        trainer.close()
    return rows


def summary(rows: list[dict]) -> dict:
    tail = rows[-min(5, len(rows)) :]
    hit = next((r["samples"] for r in rows if r.get("rollout/reward_prob_mean", 0.0) >= 0.9), None)
    return {
        "final_reward": statistics.mean(r["rollout/reward_mean"] for r in tail),
        "final_p": statistics.mean(r.get("rollout/reward_prob_mean", float("nan")) for r in tail),
        "final_kl": statistics.mean(r["objective/kl"] for r in tail),
        "samples_to_p09": hit,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/sentiment_tiny.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt of grpo and rloo")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=None, help="folder for results.json and reward.svg")
    args = ap.parse_args()
    base = [
        f"run.steps={args.steps}",
        "run.progress_bar=false",
        "run.sample_log_count=0",
        "run.tensorboard=false",
        "cluster.dashboard=false",
        *args.overrides,
    ]
    P = load_config(args.config, base).data.prompts_per_step
    try:
        curves = {e: run_side(args.config, [*base, *side_overrides(e, P, args.n)]) for e in ESTIMATORS}
    finally:
        ray.shutdown()
    stats = {e: summary(rows) for e, rows in curves.items()}

    print(f"\nbench-algos: {args.config}, {args.steps} steps, {P} samples per step (grpo/rloo: n={args.n})")
    hdr = f"{'':<28}" + "".join(f"{e:>12}" for e in ESTIMATORS)
    print(hdr)
    print("-" * len(hdr))
    marks = sorted({1, *range(5, args.steps + 1, 5), args.steps})
    for step in marks:
        vals = [curves[e][step - 1]["rollout/reward_mean"] for e in ESTIMATORS]
        print(f"{f'reward, step {step}':<28}" + "".join(f"{v:>12.3f}" for v in vals))

    def row(label: str, key: str, fmt: str) -> None:
        vals = ["-" if stats[e][key] is None else format(stats[e][key], fmt) for e in ESTIMATORS]
        print(f"{label:<28}" + "".join(f"{v:>12}" for v in vals))

    row("final reward (last 5)", "final_reward", ".3f")
    row("final P(positive)", "final_p", ".3f")
    row("final KL", "final_kl", ".3f")
    row("samples to P(pos) >= 0.9", "samples_to_p09", "d")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"summary": stats, "curves": curves}, indent=1))
        from svg_plot import line_chart

        series = {
            e: [(r["samples"], r.get("rollout/reward_prob_mean", 0.0)) for r in rows]
            for e, rows in curves.items()
        }
        plot = line_chart(
            out / "reward.svg",
            series,
            f"demo: P(positive) at equal samples (grpo/rloo n={args.n})",
            "samples",
            "P(positive)",
            log2_x=False,
        )
        print(f"results: {out / 'results.json'}, plot: {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
