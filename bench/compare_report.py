"""The report of `bench/compare_trl.py`: per-side summaries, the table, pipeline efficiency, the
settings that cannot match, curves (CSV and PNG) and result.json."""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PHASES = ("generate", "reference", "reward", "train", "weights")

# What TRL's PPO loop cannot take from this project; printed with every result.
MISMATCHES = [
    "value model: TRL trains a separate critic (a second GPT-2 backbone initialised from the policy, "
    "1-column head zeroed, no bias) with its own forward/backward; this project has a scalar value head "
    "(zeroed, with bias) on the policy's backbone, so its value loss also trains that backbone",
    "reward placement: TRL adds the score one token AFTER the EOS (the first pad position) when the "
    "response is shorter than response_length, and its value loss covers that position; this project "
    "adds it on the last real response token",
    "gradient clipping: TRL's PPO loop never clips; this project clips the global norm at learner.max_grad_norm",
    "old logprobs: TRL takes them from generate()'s scores; this project recomputes them in a learner "
    "forward with the same weights (rollout/logprob_gap ~1e-6)",
    "generation: TRL samples the whole batch in one generate() call; this project in rollout.chunk_size "
    "chunks; the sampling RNG streams differ, so the samples differ from the first step on",
    "reward: the same classifier; TRL reads it through a 1-column head W[pos]-W[neg] that skips the EOS "
    "token as this project's scorer does (see 'reward check')",
]


def summarize(res: dict, last_n: int) -> dict[str, float]:
    rows = res["steps"]
    samples, wall = sum(r["samples"] for r in rows), rows[-1]["t"]
    tail = []
    for r in reversed(rows):  # the last steps holding at least last_n samples
        tail.append(r)
        if sum(x["samples"] for x in tail) >= last_n:
            break
    n_tail = sum(r["samples"] for r in tail)
    loop = len(rows) > 1 and (samples - rows[0]["samples"]) / (wall - rows[0]["t"])
    return {
        "steps": len(rows),
        "samples": samples,
        "wall_s": wall,
        "first_step_s": rows[0]["t"],
        "samples_per_s": samples / wall,
        "loop_samples_per_s": loop or math.nan,
        "tokens_per_s": sum(r["tokens"] for r in rows) / wall,
        "reward_prob": sum(r["reward_prob_mean"] * r["samples"] for r in tail) / n_tail,
        "kl": sum(r["kl"] * r["samples"] for r in tail) / n_tail,
        "tail_samples": n_tail,
        "peak_mem_mb": res["peak_pss_mb"],
        "foreign_cpu_frac": res["foreign_cpu_frac"],
    }


ROWS = [
    ("wall_s", "wall time to all samples, start-up included (s)", "{:.1f}"),
    ("first_step_s", "  of which until step 1 is done (s)", "{:.1f}"),
    ("samples_per_s", "samples/s (whole run)", "{:.1f}"),
    ("loop_samples_per_s", "samples/s (after step 1)", "{:.1f}"),
    ("tokens_per_s", "generated tokens/s (whole run)", "{:.0f}"),
    ("reward_prob", "reward reached: mean P(positive), last samples", "{:.3f}"),
    ("kl", "KL to reference (k1, per sequence), last samples", "{:.3f}"),
    ("peak_mem_mb", "peak memory, PSS of all processes (MiB)", "{:.0f}"),
    ("foreign_cpu_frac", "CPU used by other processes meanwhile", "{:.0%}"),
]


def format_table(summary: dict[str, dict]) -> str:
    """One column per side (TRL last) and each side's ratio to TRL."""
    names = [n for n in summary if n != "trl"] + (["trl"] if "trl" in summary else [])
    ratios = [n for n in names if n != "trl" and "trl" in summary]
    head = f"{'':<50}" + "".join(f"{n:>12}" for n in names) + "".join(f"{n + '/TRL':>16}" for n in ratios)
    lines = [head, "-" * len(head)]
    for key, label, fmt in ROWS:
        values = [summary[n][key] for n in names]
        cells = "".join(f"{fmt.format(v) if not math.isnan(v) else '-':>12}" for v in values)
        b = summary["trl"][key] if "trl" in summary else math.nan
        rel = [summary[n][key] / b if b and key != "foreign_cpu_frac" else math.nan for n in ratios]
        lines.append(
            f"{label:<50}{cells}" + "".join(f"{'-' if math.isnan(r) else f'{r:.2f}':>16}" for r in rel)
        )
    return "\n".join(lines)


def efficiency(ours: dict, standalone: dict, skip: int) -> dict[str, float]:
    """Mean end-to-end iteration time against the standalone compute of the same iterations."""
    k = min(len(standalone["steps"]), len(ours["steps"]))
    lo = min(skip, max(k - 1, 0))
    sa, e2e = standalone["steps"][lo:k], [r["iteration_s"] for r in ours["steps"][lo:k]]
    out = {p: statistics.fmean(r[p] for r in sa) for p in PHASES}
    out.update(
        compute=sum(out[p] for p in PHASES), e2e=statistics.fmean(e2e), e2e_median=statistics.median(e2e)
    )
    out.update(ratio=out["e2e"] / out["compute"], first=lo + 1, last=k)
    stages = ("time/generate", "time/score", "time/train", "time/weight_sync")
    rows = ours["steps"][lo:k]
    out["e2e_stages"] = {st.split("/")[1]: statistics.fmean(r[st] for r in rows) for st in stages}
    out["e2e_stages"]["driver"] = out["e2e"] - sum(out["e2e_stages"].values())
    return out


def write_curves(path: Path, sides: dict[str, dict]) -> None:
    keys = {"p_positive": "reward_prob_mean", "kl": "kl", "reward": "reward_mean", "t_s": "t"}
    cols = ["step"] + [f"{side}_{k}" for k in keys for side in sides]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        for i in range(max(len(r["steps"]) for r in sides.values())):
            row = {"step": i + 1}
            for side, res in sides.items():
                if i < len(res["steps"]):
                    row.update({f"{side}_{k}": f"{res['steps'][i][v]:.6g}" for k, v in keys.items()})
            w.writerow(row)


def make_plot(csv_path: Path, png_path: Path, venv: Path) -> str:
    """The PNG is drawn by the TRL venv's Python, which has matplotlib (this project does not need it)."""
    py = venv / "bin" / "python"
    cmd = [str(py), str(BENCH / "trl_runner.py"), "plot", f"--csv={csv_path}", f"--png={png_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True) if py.exists() else None
    if done is None or done.returncode != 0:
        return f"none ({venv} with matplotlib is missing: run with --sides both once)"
    return str(png_path)


# ----------------------------------------------------------------------------- main


def report(result: dict, args: argparse.Namespace, out: Path, venv: Path, trl_version: str) -> None:
    sides = {k.removeprefix("this-"): result[k] for k in result if k.startswith("this-") or k == "trl"}
    summary = {k: summarize(v, args.last_n) for k, v in sides.items()}
    result["summary"] = summary
    any_side = next(iter(summary.values()))
    print(
        f"\n=== this project vs TRL {trl_version} PPOTrainer: {any_side['steps']} PPO steps, {any_side['samples']} samples each ==="
    )
    print(format_table(summary))
    print(
        f"(last samples: {any_side['tail_samples']}; TRL runs {args.trl_threads} torch threads in one process)"
    )
    if "reward_check" in result:
        rc = result["reward_check"]
        print(
            f"reward check: TRL's reward - this project's, {rc['samples']} samples: max |diff| {rc['max_abs_diff']:.1e}"
        )
    print("\nsettings that cannot match:\n" + "\n".join(f"  - {m}" for m in MISMATCHES))
    for name, e in result.get("efficiency", {}).items():
        parts = ", ".join(f"{p} {e[p]:.3f}" for p in PHASES)
        print(f"\npipeline efficiency ({name}), iterations {e['first']}..{e['last']}:")
        print(f"  standalone compute (one process, no Ray) {e['compute']:.3f} s/iteration ({parts})")
        print(
            f"  end-to-end iteration (Ray)              {e['e2e']:.3f} s/iteration (median {e['e2e_median']:.3f})"
        )
        stages = ", ".join(f"{p} {v:.3f}" for p, v in e["e2e_stages"].items())
        print(f"  end-to-end stages (the step's own timers) {stages}")
        print(f"  end-to-end / standalone                 {e['ratio']:.2f}")
        print(f"  {result[name].get('startup', {}).get('line', '')}")
    busy = max(s["foreign_cpu_frac"] for s in summary.values())
    if busy > 0.1:
        print(
            f"\nWARNING: other processes used {busy:.0%} of the CPUs during a run: the timings are unreliable"
        )
    write_curves(out / "curves.csv", sides)
    plotted = make_plot(out / "curves.csv", out / "curves.png", venv)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(f"\ncurves: {out / 'curves.csv'}\nplot:   {plotted}\nresult: {out / 'result.json'}")
