"""The arithmetic demo's robustness over build seeds (a seed stands in for a different machine: other
weights, corpus and split from the same procedure): the pretrained policy's held-out accuracy against
the build's band, and with --rl the default RL run from each build.

    .venv/bin/python bench/bench_arithmetic_build.py [--seeds 0 1 2] [--jobs 2] [--rl] [--out runs/arith-build]

Each build runs in its own process on one thread (`python -m demos.arithmetic --no-band`, so a build
that misses the band is still measured), `--jobs` at a time. With --rl each build then gets
`make train CONFIG=configs/arithmetic_tiny.yaml` (one at a time), and its final policy is scored on the
held-out problems (sampled and greedy). Printed: a table per seed; written: OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.reporting.metrics import read_metrics  # noqa: E402
from demos.arithmetic import BAND, AssetPaths  # noqa: E402
from demos.common import read_manifest  # noqa: E402

CONFIG = ROOT / "configs" / "arithmetic_tiny.yaml"


def build(seed: int, out: Path, lm_steps: int | None) -> dict:
    folder = out / f"seed-{seed}"
    cmd = [sys.executable, "-m", "demos.arithmetic", "--out", str(folder), "--seed", str(seed), "--no-band"]
    cmd += ["--quiet", "--force"] + ([] if lm_steps is None else ["--lm-steps", str(lm_steps)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    m = read_manifest(folder) or {}
    metrics = m.get("metrics", {})
    return {
        "seed": seed,
        "folder": str(folder),
        "build_s": round(time.perf_counter() - t0, 1),
        "sampled": metrics.get("held_out_sampled_accuracy"),
        "greedy": metrics.get("held_out_greedy_accuracy"),
        "selection_greedy": metrics.get("selection_greedy_accuracy"),
        "selected_step": (m.get("selection") or {}).get("step"),
        "in_band": not BAND.misses(metrics),
    }


def rl(row: dict, out: Path, overrides: list[str]) -> dict:
    assets = AssetPaths.under(Path(row["folder"]))
    run_dir = out / f"seed-{row['seed']}-rl"
    sets = [
        f"model.policy_path={assets.policy}",
        "model.demo_assets=null",
        f"data.prompts_path={assets.prompts}",
        f"eval.prompts_path={assets.eval_prompts}",
        "run.progress_bar=false",
        "cluster.dashboard=false",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "cluster.train", str(CONFIG), "--run-dir", str(run_dir)]
    cmd += [x for s in sets for x in ("--set", s)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    final = evals[-1]
    greedy, sampled = final_scores(run_dir / "final", assets)
    return {
        "rl_wall_s": round(wall, 1),
        "rl_steps": max(r["step"] for r in rows),
        "rl_samples": int(sum(r.get("rollout/samples", 0) for r in rows)),
        "rl_start": evals[0]["eval/accuracy"],
        "rl_final": final["eval/accuracy"],
        "rl_best": max(r["eval/accuracy"] for r in evals),
        "rl_pass": {k[5:]: v for k, v in final.items() if k.startswith(("eval/pass@", "eval/mean@"))},
        "rl_final_greedy": greedy,
        "rl_final_sampled_check": sampled,
        "rl_curve": [(r["step"], r["eval/accuracy"]) for r in evals],
    }


def final_scores(policy: Path, assets: AssetPaths) -> tuple[float, float]:
    """Held-out greedy and sampled accuracy of a trained policy, scored as the build scores its own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from demos.arithmetic import accuracy

    lm = AutoModelForCausalLM.from_pretrained(policy, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(policy, local_files_only=True)
    pairs = []
    for line in assets.eval_prompts.read_text().splitlines():
        a, b = json.loads(line)["prompt"][:-1].split("+")
        pairs.append((int(a), int(b)))
    torch.manual_seed(0)
    return accuracy(lm, tok, pairs, greedy=True), accuracy(lm, tok, pairs, greedy=False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--jobs", type=int, default=2, help="builds at a time (one thread each)")
    ap.add_argument("--lm-steps", type=int, default=None)
    ap.add_argument("--reuse", action="store_true", help="skip builds already in OUT (measure RL only)")
    ap.add_argument("--rl", action="store_true", help="also run the default RL config from each build")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="RL config override")
    ap.add_argument("--out", default="runs/arith-build")
    args = ap.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    def one(seed: int) -> dict:
        folder = out / f"seed-{seed}"
        m = read_manifest(folder) if args.reuse else None
        if m is None:
            return build(seed, out, args.lm_steps)
        metrics = m["metrics"]
        return {
            "seed": seed,
            "folder": str(folder),
            "build_s": sum(m["timings_s"].values()),
            "sampled": metrics["held_out_sampled_accuracy"],
            "greedy": metrics["held_out_greedy_accuracy"],
            "selection_greedy": metrics.get("selection_greedy_accuracy"),
            "selected_step": (m.get("selection") or {}).get("step"),
            "in_band": not BAND.misses(metrics),
        }

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, args.seeds))
    if args.rl:
        for row in rows:
            row.update(rl(row, out, args.overrides))
    (out / "results.json").write_text(json.dumps(rows, indent=1))

    print(f"\narithmetic builds: band {BAND.describe()}")
    print(f"{'seed':>4} {'sampled':>8} {'greedy':>7} {'sel.step':>8} {'build s':>8} {'band':>5}", end="")
    print(f" {'RL final':>8} {'best':>6} {'greedy':>7} {'steps':>6} {'RL s':>6}" if args.rl else "")
    for r in rows:
        print(
            f"{r['seed']:>4} {r['sampled']:>8.3f} {r['greedy']:>7.3f} {r['selected_step']!s:>8} "
            f"{r['build_s']:>8.1f} {'ok' if r['in_band'] else 'MISS':>5}",
            end="",
        )
        if args.rl:
            print(
                f" {r['rl_final']:>8.3f} {r['rl_best']:>6.3f} {r['rl_final_greedy']:>7.3f} "
                f"{r['rl_steps']:>6} {r['rl_wall_s']:>6.1f}  {r['rl_pass']}",
                end="",
            )
        print()
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
