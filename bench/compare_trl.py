"""This project against TRL's PPOTrainer on the demo, side by side, with matched settings.

    .venv/bin/python bench/compare_trl.py [--steps 150] [--config configs/sentiment_tiny.yaml] [--set k=v]

Installs trl 1.12.0 (torch 2.13.0) into .venv-trl when missing, checks that TRL's reward equals this
project's on real samples, then runs TRL (bench/trl_runner.py, inside .venv-trl) and this project (a
subprocess of this script), one after the other, each from a cold process to the same number of
samples, then the standalone compute of the same iterations (bench/standalone.py, no Ray). Prints one
table, the settings that cannot match and the pipeline efficiency; writes result.json, curves.csv and
curves.png under runs/compare_trl-<time>/. Nothing is asserted.

Memory is the peak proportional set size (PSS) summed over each side's whole process tree (Ray's
daemons and actors included), sampled every --sample-s seconds. The CPU used meanwhile by processes
outside the tree is reported too: on a shared machine it makes the timings unreliable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
TRL_VERSION = "1.12.0"
TORCH_VERSION = "2.13.0"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from compare_report import efficiency, report  # noqa: E402
from machine import TreeSampler, log, wait_for_idle  # noqa: E402

# ----------------------------------------------------------------------------- TRL venv


def installed_versions(py: Path) -> dict[str, str] | None:
    code = "import json, torch, trl; print(json.dumps({'torch': torch.__version__, 'trl': trl.__version__}))"
    if not py.exists():
        return None
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


def ensure_trl_venv(venv: Path) -> Path:
    """A virtual environment with trl==TRL_VERSION, torch==TORCH_VERSION (CPU) and matplotlib."""
    py = venv / "bin" / "python"
    have = installed_versions(py)
    if have and have["trl"] == TRL_VERSION and have["torch"].split("+")[0] == TORCH_VERSION:
        return py
    log(f"installing trl=={TRL_VERSION} and torch=={TORCH_VERSION} into {venv} (about a minute)")
    pip = [str(py), "-m", "pip", "install", "-q"]
    steps = [] if py.exists() else [["python3", "-m", "venv", str(venv)]]
    # torch first and pinned again: a requirement that admits a newer torch pulls CUDA wheels.
    steps += [
        [*pip, f"torch=={TORCH_VERSION}"],
        [*pip, f"trl=={TRL_VERSION}", "matplotlib", f"torch=={TORCH_VERSION}"],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if not ln.startswith("WARNING")]
            raise RuntimeError(f"{' '.join(cmd)} failed:\n" + "\n".join(errors[-20:]))
    if (installed_versions(py) or {}).get("trl") != TRL_VERSION:
        raise RuntimeError(f"{venv}: trl {TRL_VERSION} is still not importable after the install")
    return py


# ----------------------------------------------------------------------------- matched settings


def trl_args(cfg: Any, steps: int) -> list[str]:
    """bench/trl_runner.py arguments equal to this project's config; raises on what TRL cannot do."""
    s, lc = cfg.rollout.sampling, cfg.resolved.learner  # off_policy 'auto' decided
    batch = cfg.data.prompts_per_step * s.n
    problems = [
        text
        for bad, text in [
            (s.top_k or s.top_p < 1.0, "sampling top_k/top_p (TRL: top_k=0, top_p=1)"),
            (lc.kl.adaptive or lc.kl.estimator == "k2", "adaptive KL or k2 (TRL: fixed coef, k1/k3)"),
            (
                lc.clip.eps_high or lc.clip.dual or lc.off_policy != "none",
                "clip.eps_high/clip.dual/off_policy",
            ),
            (lc.entropy_coef or lc.warmup_steps, "entropy_coef/warmup_steps (TRL has neither)"),
            (lc.lr_schedule != "constant", "learner.lr_schedule (the TRL runner's is constant)"),
            (not lc.whiten_advantages or lc.loss_agg != "token-mean", "whitening off or loss_agg"),
            (batch % lc.num_minibatches, "rollout batch not a multiple of learner.num_minibatches"),
            (lc.micro_batch_size < batch // lc.num_minibatches, "micro_batch_size below the minibatch"),
        ]
        if bad
    ]
    if problems:
        raise ValueError("settings TRL's PPO loop cannot match: " + "; ".join(problems))
    values = {
        "steps": steps,
        "batch-size": batch,
        "num-minibatches": lc.num_minibatches,
        "ppo-epochs": lc.ppo_epochs,
        "response-length": s.max_new_tokens,
        "temperature": s.temperature,
        "lr": lc.lr,
        "adam-betas": f"{lc.adam_betas[0]},{lc.adam_betas[1]}",
        "adam-eps": lc.adam_eps,
        "weight-decay": lc.weight_decay,
        "kl-coef": lc.kl.coef,
        "kl-estimator": lc.kl.estimator,
        "cliprange": lc.clip.eps,
        "cliprange-value": lc.value_clip_eps,
        "vf-coef": lc.vf_coef,
        "gamma": lc.gamma,
        "lam": lc.params("gae").lam,
        "seed": cfg.run.seed,
        "positive-label": cfg.reward.positive_label,
    }
    return [f"--{k}={v}" for k, v in values.items()]


def prompt_order(cfg: Any, steps: int) -> list[list[int]]:
    """Token ids of every prompt this project trains on, in order; n samples = n repeats in a row."""
    from transformers import AutoTokenizer

    from cluster.prompts.loader import PromptStream, read_prompts, tokenize_prompts

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
    stream = PromptStream(
        tokenize_prompts(read_prompts(cfg.data), tok, cfg.data)[0], cfg.run.seed, cfg.data.shuffle
    )
    batches = [stream.next_batch(cfg.data.prompts_per_step) for _ in range(steps)]
    return [p.ids.tolist() for b in batches for p in b for _ in range(cfg.rollout.sampling.n)]


def reward_samples(cfg: Any, count: int = 64) -> dict[str, list]:
    """Policy samples scored by this project's RewardScorer, for the reward equality check."""
    import numpy as np

    from reward_service.scorer import RewardScorer
    from rollout_workers.worker import RolloutWorker

    ids = [np.asarray(x) for x in prompt_order(cfg, 1)[:count]]
    samples = RolloutWorker(cfg.model.policy_path, cfg.rollout).generate(list(range(len(ids))), ids, 1234)
    p_ids, r_ids = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    scores = RewardScorer(cfg.reward, cfg.tokenizer_path).score(p_ids, r_ids).scores
    return {
        "prompts": [p.tolist() for p in p_ids],
        "responses": [r.tolist() for r in r_ids],
        "scores": scores.tolist(),
    }


# ----------------------------------------------------------------------------- this project's side


def quiet_overrides(steps: int) -> list[str]:
    return [
        f"run.steps={steps}",
        "run.progress_bar=false",
        "run.sample_log_count=0",
        "eval.prompts_path=null",  # no held-out evaluation inside the timed steps
        "run.loggers=[jsonl,prometheus]",
    ] + ["cluster.dashboard=false"]


def run_ours_inprocess(config: str, overrides: list[str], steps: int, out: Path) -> None:
    """In a fresh subprocess: `steps` iterations of the real Ray pipeline, each one recorded."""
    import ray

    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run
    from cluster.reporting.startup_clock import StartupClock
    from cluster.train import init_ray, preflight

    clock = StartupClock()
    cfg = load_config(config, [*quiet_overrides(steps), *overrides])
    preflight(cfg)
    clock.mark("driver start")
    init_ray(cfg)
    clock.mark("ray.init")
    marks = {"ray_ready": time.time()}
    trainer = Run(cfg, Path(tempfile.mkdtemp(prefix="compare-trl-ours-")), clock=clock)
    rows = []
    try:
        marks["actors_ready"] = time.time()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            m = trainer.iteration()
            if step == 1:
                clock.mark("step 1")
            n = int(m["rollout/samples"])
            rows.append(
                {
                    "step": step,
                    "t": time.time(),  # wall clock: the caller subtracts its launch time
                    "iteration_s": time.perf_counter() - t0,
                    "samples": n,
                    "tokens": int(round(m["rollout/response_length"] * n)),
                    "reward_mean": m["rollout/reward_mean"],
                    "reward_prob_mean": m.get("rollout/reward_prob_mean", math.nan),
                    "kl": m.get("objective/kl", math.nan),
                    **{k: m[k] for k in ("time/generate", "time/score", "time/train", "time/weight_sync")},
                }
            )
    finally:
        trainer.close()
        ray.shutdown()
    startup = {"phases_s": clock.phases(), "learner_process_s": clock.actor, "line": clock.line()}
    out.write_text(json.dumps({"side": "ours", "steps": rows, "marks": marks, "startup": startup}))


# ----------------------------------------------------------------------------- process-tree sampling


def run_side(name: str, cmd: list[str], out: Path, args: argparse.Namespace, env=None) -> dict:
    """Run one side from a cold process; add peak memory and foreign CPU to the JSON it writes."""
    wait_for_idle(args.wait_idle)
    log(f"{name}: {' '.join(cmd[:3])} ...")
    t_launch = time.time()
    # A session of its own: a timeout then ends the side's whole process group (Ray's daemons too).
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **pipe)
    sampler = TreeSampler(proc.pid, args.sample_s)
    sampler.start()
    try:
        output, _ = proc.communicate(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\n(killed: --timeout-s {args.timeout_s:.0f} reached)"
    finally:
        usage = sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); last output:\n{output[-3000:]}")
    result = {**json.loads(out.read_text()), **usage}
    for row in result["steps"]:
        if "t" in row:
            row["t"] -= t_launch  # seconds since this side's process was launched
    result["marks"] = {k: v - t_launch for k, v in result.get("marks", {}).items()}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/sentiment_tiny.yaml")
    ap.add_argument("--steps", type=int, default=150, help="PPO steps of each side")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="this project's config")
    ap.add_argument("--sides", choices=["both", "ours", "trl"], default="both")
    ap.add_argument(
        "--placements",
        default="separate,colocated",
        help="this project's cluster.placement values, one cold run each (comma-separated)",
    )
    ap.add_argument("--last-n", type=int, default=320, help="samples the final reward and KL average over")
    ap.add_argument("--standalone-steps", type=int, default=None, help="default: --steps, at most 40")
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the efficiency means")
    ap.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="TRL's torch threads")
    ap.add_argument("--trl-venv", default=str(ROOT / ".venv-trl"))
    ap.add_argument("--out-dir", default=None, help="default: runs/compare_trl-<time>")
    ap.add_argument("--sample-s", type=float, default=1.0, help="memory/CPU sampling period")
    ap.add_argument("--wait-idle", type=float, default=60.0, help="max wait for an idle machine, per side")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="time limit of each side")
    ap.add_argument("--side-ours", default=None, help=argparse.SUPPRESS)  # internal: run our side here
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = str(Path(args.config).resolve())
    if args.side_ours:
        run_ours_inprocess(config, args.overrides, args.steps, Path(args.side_ours))
        return 0
    from cluster.config.schema import load_config
    from cluster.train import preflight

    cfg = load_config(config, [*quiet_overrides(args.steps), *args.overrides])
    preflight(cfg)  # builds the demo assets when missing
    out = Path(args.out_dir or ROOT / "runs" / f"compare_trl-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    venv = Path(args.trl_venv)
    result: dict[str, Any] = {"steps": args.steps, "config": config, "overrides": args.overrides}
    if args.sides in ("both", "trl"):
        result.update(run_trl(cfg, args, out, ensure_trl_venv(venv)))
    if args.sides in ("both", "ours"):
        sets = [a for o in args.overrides for a in ("--set", o)]
        me, common = [sys.executable, str(Path(__file__).resolve())], [f"--config={config}", *sets]
        for placement in args.placements.split(","):
            side, file = f"this-{placement}", out / f"ours-{placement}.json"
            cmd = [
                *me,
                f"--steps={args.steps}",
                f"--side-ours={file}",
                *common,
                f"--set=cluster.placement={placement}",
            ]
            result[side] = run_side(f"this project ({placement})", cmd, file, args)
        k = args.standalone_steps or min(args.steps, 40)
        cmd = [
            sys.executable,
            str(BENCH / "standalone.py"),
            f"--steps={k}",
            f"--out={out / 'standalone.json'}",
        ]
        result["standalone"] = run_side("standalone", [*cmd, *common], out / "standalone.json", args)
        result["efficiency"] = {
            name: efficiency(result[name], result["standalone"], args.warmup)
            for name in result
            if name.startswith("this-")
        }
    report(result, args, out, venv, TRL_VERSION)
    return 0


def run_trl(cfg: Any, args: argparse.Namespace, out: Path, py: Path) -> dict[str, Any]:
    """The reward equality check, then TRL's run, in the TRL venv with its own thread settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(args.trl_threads), MKL_NUM_THREADS=str(args.trl_threads))
    base = [str(py), str(BENCH / "trl_runner.py")]
    models = [
        f"--policy={cfg.model.policy_path}",
        f"--reward={cfg.reward.model_path}",
        f"--threads={args.trl_threads}",
    ]
    (out / "reward_samples.json").write_text(json.dumps(reward_samples(cfg)))
    check = [
        *base,
        "verify-reward",
        *models,
        f"--samples={out / 'reward_samples.json'}",
        f"--out={out / 'check.json'}",
    ]
    subprocess.run(check, cwd=ROOT, env=env, check=True, capture_output=True)
    (out / "prompts.json").write_text(json.dumps({"input_ids": prompt_order(cfg, args.steps)}))
    run = [*base, "run", *models, f"--prompts={out / 'prompts.json'}", f"--out={out / 'trl.json'}"]
    trl = run_side("TRL", [*run, *trl_args(cfg, args.steps)], out / "trl.json", args, env)
    return {"reward_check": json.loads((out / "check.json").read_text()), "trl": trl}


if __name__ == "__main__":
    sys.exit(main())
