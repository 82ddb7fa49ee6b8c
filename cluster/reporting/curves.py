"""A run's curves as a PNG from its metrics.jsonl (`plot_run`; drawn at the end of a run and by `python -m cluster.plot`).

Six panels against the step: training reward with the held-out reward, KL to the reference, held-out
accuracy with pass@k for every k the run evaluated (or P(positive) for classifier rewards), response
length (training and held-out), dynamic sampling (groups filtered, and left short, per step; for runs
with multi-turn episodes: turns per episode and the rate of tool calls and other environment counters),
and throughput (samples per second). A panel whose metrics the run did not record says so. The held-out
curves run from the evaluation before training (step 0) to the one after it (the last step's second row).
Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import math
from pathlib import Path

from cluster.reporting.metrics import read_metrics

# (panel title, [(metric key, legend label)])
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    (
        "mean reward",
        [
            ("rollout/reward_mean", "train reward"),
            ("eval/reward_mean", "held-out reward"),
        ],
    ),
    ("KL to reference", [("objective/kl", "KL")]),
    (
        "held-out",
        [
            ("eval/accuracy", "held-out accuracy"),
            ("eval/reward_prob_mean", "held-out P(positive)"),
            ("rollout/reward_prob_mean", "train P(positive)"),
        ],
    ),
    ("response length", [("rollout/response_length", "train"), ("eval/response_length", "held-out")]),
    (
        "dynamic sampling",
        [("dynamic/filtered_groups", "groups filtered"), ("dynamic/shortfall_groups", "groups short")],
    ),
    ("throughput", [("throughput/samples_per_s", "samples/s")]),
]


# In place of the dynamic-sampling panel for runs with multi-turn episodes: turns and each counter's rate
EPISODES = "episodes"


def panels(rows: list[dict]) -> list[tuple[str, list[tuple[str, str]]]]:
    """`PANELS` with the held-out panel extended by the run's eval/pass@k keys (k > 1, by k); for a run with
    multi-turn episodes, the dynamic-sampling panel shows turns per episode and the share of episodes
    using each environment counter (e.g. tool calls), training and held-out."""
    ks = sorted({int(k.rsplit("@", 1)[1]) for r in rows for k in r if k.startswith("eval/pass@")} - {1})
    extra = [(f"eval/pass@{k}", f"held-out pass@{k}") for k in ks]
    out = [(title, keys + extra if title == "held-out" else keys) for title, keys in PANELS]
    rates = sorted({k[4:] for r in rows for k in r if k.startswith("env/") and k.endswith("_rate")})
    if any("env/turns" in r for r in rows):
        keys = [("env/turns", "turns"), ("eval/env/turns", "held-out turns")]
        for rate in rates:
            name = rate.removesuffix("_rate").replace("_", " ")
            keys += [(f"env/{rate}", f"{name} rate"), (f"eval/env/{rate}", f"held-out {name} rate")]
        out = [(EPISODES, keys) if title == "dynamic sampling" else (title, k) for title, k in out]
    return out


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the rows that hold a finite value of it."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's curves as a PNG (default RUN_DIR/curves.png); returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {run_dir} a run folder?)")
    rows = read_metrics(path)
    out = Path(out) if out else run_dir / "curves.png"
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, panels(rows), strict=True):
        drawn = False
        for key, label in keys:
            xs, ys = series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(run_dir.name)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
