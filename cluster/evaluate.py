"""Held-out evaluation without training: `python -m cluster.evaluate CONFIG --policy PATH [--set ...]`.

The run CONFIG's roles start exactly as `cluster.train` starts them (its placement, either engine, its
reward functions), with `model.policy_path` set to PATH (a run's `final/`, a `cluster.export` folder,
or any save_pretrained folder), and score `eval.prompts_path` once, as a training run scores its
held-out prompts before and after training: the same sampling (`eval.samples_per_prompt`, greedy or
not), the same chunk seeds (so two policies are compared on the same random numbers, and the initial
policy gets the metrics of a training run's 'before' row), the same metrics (eval/reward_mean,
eval/mean@n and eval/pass@k for the ks of `eval.pass_k`, one eval/reward/<name> per reward function).
The report is printed with a few samples and written as JSON (`--out`, default `<run folder>/eval.json`).
No step is trained and no checkpoint is written; the learner ranks still start (the colocated placement
hosts the rollout engine beside them), which costs their start-up, not their memory over time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

from cluster.config.schema import ConfigError
from cluster.train import EXIT_BAD_INPUT, EXIT_FAILED, add_config_arguments, init_ray, preflight, run_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m cluster.evaluate", description=__doc__.split("\n")[0])
    add_config_arguments(ap)
    ap.add_argument("--policy", required=True, help="policy folder to evaluate (save_pretrained layout)")
    ap.add_argument("--run-dir", default=None, help="folder for the roles' logs and eval.json")
    ap.add_argument("--out", default=None, help="the JSON report (default: <run folder>/eval.json)")
    return ap.parse_args(argv)


def _finite(metrics: dict) -> dict:
    """JSON has no NaN: a metric with no value (e.g. no correctness column) is written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.overrides = [*args.overrides, f"model.policy_path={args.policy}"]
    try:
        cfg = run_config(args)
        prompts = preflight(cfg)
        if not prompts.eval:
            raise ConfigError(
                "eval.prompts_path: no held-out prompts to evaluate (set it, e.g. --set eval.prompts_path=FILE)"
            )
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT

    import ray

    from cluster.pipeline.evaluation import print_eval
    from cluster.pipeline.run import Run
    from cluster.train import run_dir_for

    own_ray = not ray.is_initialized()
    init_ray(cfg)
    run_dir = run_dir_for(cfg, args.run_dir)
    print(f"run folder: {run_dir}", flush=True)
    trainer = None  # None until set-up completes (a failed set-up stops what it started)
    try:
        trainer = Run(cfg, run_dir, data=prompts)
        metrics, batch = trainer.evaluator.evaluate()
        print_eval(f"held-out prompts, policy {args.policy}", metrics, batch, trainer.tokenizer, cfg)
    except Exception as err:  # noqa: BLE001 - any failure ends the evaluation with its message
        traceback.print_exc()
        print(f"\nerror: {err}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if trainer is not None:
            trainer.close()
        if own_ray:
            ray.shutdown()
    out = Path(args.out) if args.out else run_dir / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "policy": str(Path(args.policy).resolve()),
        "config": str(Path(args.config).resolve()),
        "engine": cfg.rollout.engine,
        "placement": cfg.cluster.placement,
        "prompts": len(prompts.eval),
        "samples_per_prompt": cfg.eval.samples_per_prompt,
        "greedy": cfg.eval.greedy,
        "metrics": _finite(metrics),
    }
    out.write_text(json.dumps(report, indent=1))
    print(f"report       {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
