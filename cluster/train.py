"""Command line: `python -m cluster.train CONFIG [--set a.b=c ...]`.

Everything that can be checked before an actor starts is checked first; a bad config or a
missing file exits with code 2 and a message that names the field or file.

Exit codes: 0 done; 1 the run failed; 2 bad input; 130 stopped by SIGINT; 143 stopped by SIGTERM
(`cluster/pipeline/stopping.py`: the current step ends, a checkpoint is written, `--resume` continues it).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.config.notices import announce_config
from cluster.config.schema import ConfigError, RunConfig, load_config
from cluster.pipeline.checkpoint import CheckpointError, find_auto_resume, latest_checkpoint
from cluster.prompts.loader import RunPrompts, load_run_prompts, load_tokenizer
from cluster.prompts.prompt_files import prompt_files
from cluster.reporting.folder import resolve_paths
from cluster.reporting.job_env import (
    SharedSessionError,
    join_cluster,
)
from cluster.reporting.local_ray import dashboard_port, moved_dashboard
from cluster.roles.registry import ROLES
from kernel.registry import resolve
from reward_service.backends import REWARD_KINDS

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def preflight(cfg: RunConfig) -> RunPrompts:
    """Build the demo assets if asked, check every path the actors will open, then check a chat
    environment's template, then read and render the prompts (`cluster.prompts.loader`, as `python -m
    cluster.data` shows them): a bad row is found before any actor starts, and rows dropped, cut or read
    as JSON messages are said on stderr (`RunPrompts.announce`), as are settings the run leaves unused
    (`cluster.config.notices`). Returns the prompts, which the run then uses instead of reading them again."""
    if cfg.model.demo_assets:
        from cluster.demo_assets import DemoAssetsError, build_demo_assets

        try:
            build_demo_assets(cfg.model.demo_assets.demo, cfg.model.demo_assets.folder)
        except DemoAssetsError as err:
            raise ConfigError(f"model.demo_assets: {err}") from None
    checks = [("model.policy_path", cfg.model.policy_path, "config.json")]
    if cfg.model.tokenizer_path:
        checks.append(("model.tokenizer_path", cfg.model.tokenizer_path, None))
    for role in ROLES:  # the model folders of the roles this run starts (reference, reward, judge)
        if role.runs(cfg):
            for attrs in role.path_attributes():
                value = functools.reduce(getattr, attrs, cfg)
                if value:
                    checks.append((".".join(attrs), value, "config.json"))
    for field, path, must_hold in checks:
        p = Path(path)
        if not p.is_dir():
            raise ConfigError(f"{field}: folder not found: {path}")
        if must_hold and not (p / must_hold).is_file():
            raise ConfigError(f"{field}: {path} has no {must_hold} (expected a save_pretrained folder)")
    from cluster.config.sinks import missing_packages

    missing = missing_packages(cfg.run.loggers)
    if missing:
        raise ConfigError(f"run.loggers: {'; '.join(missing)}")
    prompt_files(cfg.data.prompts_path, "data.prompts_path")
    if cfg.eval.prompts_path:
        prompt_files(cfg.eval.prompts_path, "eval.prompts_path")
    # the reward kind's own check before any actor starts (the rule kind's: its functions load)
    check = REWARD_KINDS[cfg.reward.kind].check
    if check is not None:
        try:
            resolve(check)(cfg.reward)
        except (ValueError, ImportError) as err:  # the message names the field
            raise ConfigError(str(err)) from None
    tokenizer = load_tokenizer(cfg)
    check_observation_template(cfg, tokenizer if cfg.tokenizer_path == cfg.model.policy_path else None)
    prompts = load_run_prompts(cfg, tokenizer)
    prompts.announce(cfg)  # rows dropped, cut or read as JSON messages: said before step 1
    announce_config(cfg)  # settings the run leaves unused
    return prompts


def check_observation_template(cfg: RunConfig, policy_tokenizer: Any = None) -> None:
    """A chat environment's observations (`observation_format: chat`) are rendered by the policy's
    tokenizer with the prompts' template: a template the workers would refuse
    (`rollout_workers.chat_turns.check_chat_template`: a role it cannot render, past turns rewritten) is
    refused here, before any actor starts, with the same message. `policy_tokenizer`: the policy's
    tokenizer where the caller has it loaded already (None: loaded here)."""
    if not (cfg.rollout.environment.enabled and cfg.rollout.environment.observation_format == "chat"):
        return
    from transformers import AutoTokenizer

    from cluster.placement.rollout_gpus import worker_config
    from rollout_workers.chat_turns import check_chat_template

    try:
        env = worker_config(cfg).environment  # the template and kwargs the workers are sent
    except ValueError as err:  # the message names the field
        raise ConfigError(str(err)) from None
    try:
        tokenizer = policy_tokenizer
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.policy_path, local_files_only=True)
        check_chat_template(tokenizer, env.observation_role, env.chat_template, env.chat_template_kwargs)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{err} (the policy's tokenizer, model.policy_path={cfg.model.policy_path})"
        ) from None


def local_resources(cfg: RunConfig) -> tuple[float, dict[str, float]]:
    """Logical CPUs and custom resources of a local Ray: what the placement plan asks for (one
    local node is every node type at once), and at least the cores."""
    from cluster.placement.plan import demand

    want = demand(cfg)
    cpus = float(max(os.cpu_count() or 1, math.ceil(want.pop("CPU", 0.0))))  # Ray wants whole CPUs
    want.pop("GPU", None)  # detected, or cluster.num_gpus
    return cpus, want


def init_ray(cfg: RunConfig) -> str | None:
    """Connect to the configured cluster, or start a local one; returns the dashboard URL. A local
    Ray's dashboard port set in the config and taken is a ConfigError before Ray starts; unset, Ray takes
    8265 or the next free one, and a moved port is printed (`cluster.reporting.local_ray`)."""
    import ray

    if ray.is_initialized():
        return None
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:  # a job on raylets sharing this machine's session folder: its working dir in place
        return join_cluster(address, log_to_driver=True).dashboard_url
    cpus, custom = local_resources(cfg)
    port = dashboard_port(cfg.cluster)
    url = ray.init(
        address="local",  # a new Ray even where `ray start` left one: no address would join it
        num_cpus=cfg.cluster.num_cpus or cpus,
        resources=custom or None,
        num_gpus=cfg.cluster.num_gpus,
        include_dashboard=cfg.cluster.dashboard,
        dashboard_host=cfg.cluster.dashboard_host,
        dashboard_port=port,
        log_to_driver=True,
    ).dashboard_url
    moved = moved_dashboard(url, cfg.cluster)
    if moved:
        print(moved, flush=True)
    return url


def run_dir_for(cfg: RunConfig, explicit: str | None, resolve: bool = True) -> Path:
    """The run folder, absolute: every actor and node must mean the same folder by it. `resolve=False`
    (a submitter naming the folder for the cluster) keeps a relative one relative: the job's driver
    resolves it against its own working dir."""
    folder = (
        Path(explicit)
        if explicit
        else Path(cfg.run.output_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    return folder.resolve() if resolve else folder


def add_config_arguments(ap: argparse.ArgumentParser) -> None:
    """CONFIG and its --set overrides, shared by every command that reads a run config."""
    ap.add_argument("config", help="YAML run config, e.g. configs/sentiment_tiny.yaml")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set learner.lr=1e-5 (repeatable)",
    )


def run_config(args: argparse.Namespace) -> RunConfig:
    """The config `add_config_arguments` named, overrides applied, its paths made absolute here."""
    return resolve_paths(load_config(args.config, args.overrides))


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments that name a run, shared by `cluster.train` and `cluster.submit`."""
    add_config_arguments(ap)
    ap.add_argument(
        "--run-dir", default=None, help="run folder (default: <run.output_dir>/<run.name>-<time>)"
    )
    ap.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR|auto",
        help="continue a run from its newest complete checkpoint ('auto': newest run of this name)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m cluster.train", description="Train a policy with PPO on Ray."
    )
    add_run_arguments(ap)
    return ap.parse_args(argv)


def resolve_resume(cfg: RunConfig, resume: str | None) -> tuple[Path | None, Path | None]:
    """(run folder, checkpoint folder) to continue, or (None, None) for a fresh run."""
    if not resume:
        return None, None
    run_dir = find_auto_resume(cfg.run.output_dir, cfg.run.name) if resume == "auto" else Path(resume)
    return run_dir.resolve(), latest_checkpoint(run_dir)


def main(argv: list[str] | None = None, learner_gate: Callable[[], bool] | None = None) -> int:
    """`python -m cluster.train`. `learner_gate`: held while it says True (async; what a fault test
    injects, `cluster.pipeline.pipelines.LearnerGate`)."""
    args = parse_args(argv)
    try:
        cfg = run_config(args)
        prompts = preflight(cfg)
        resume_dir, ckpt = resolve_resume(cfg, args.resume)
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT

    from cluster.pipeline.collector import RolloutError
    from cluster.pipeline.failures import EnvironmentFailureError, RewardFailureError
    from cluster.pipeline.learner_calls import LearnerStepError
    from cluster.pipeline.run import Run
    from cluster.pipeline.stopping import StopRequest
    from cluster.placement.pools import ActorStartError
    from cluster.records.deadlines import WaitTimeout
    from cluster.reporting.folder import SharedStorageError
    from cluster.weights.push import WeightSyncError

    RUN_ERRORS = (
        LearnerStepError,
        RewardFailureError,
        EnvironmentFailureError,
        RolloutError,
        WeightSyncError,
        ActorStartError,
        CheckpointError,
        SharedStorageError,
        WaitTimeout,
    )

    import ray

    from cluster.reporting.startup_clock import StartupClock

    clock = StartupClock()
    clock.mark("driver start")
    own_ray = not ray.is_initialized()  # a local Ray this driver starts is shut down when it ends
    try:
        dashboard = init_ray(cfg)
    except SharedSessionError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigError as err:  # before Ray started: cluster.dashboard_port taken
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    clock.mark("ray.init")
    run_dir = resume_dir or run_dir_for(cfg, args.run_dir)
    print(f"ray dashboard: http://{dashboard}" if dashboard else "ray: connected (no dashboard)", flush=True)
    print(f"run folder: {run_dir}" + (f" (resuming from {ckpt.name})" if ckpt else ""), flush=True)
    stop = StopRequest(cfg.checkpoint.stop_grace_s)
    stop.install()  # after ray.init, which replaces SIGTERM handlers (see cluster/pipeline/stopping.py)
    trainer: Run | None = None  # None until set-up completes (a failed set-up stops what it started)
    summary, curves = None, None
    try:
        trainer = Run(
            cfg, run_dir, resume_from=ckpt, data=prompts, clock=clock, learner_gate=learner_gate, stop=stop
        )
        if cfg.cluster.placement == "separate":
            print(
                f"scale rollout workers: python -m cluster.scale --run {trainer.run_id} rollout=K", flush=True
            )
        summary = trainer.train()
    except KeyboardInterrupt:  # forced during set-up or the final save: no new checkpoint
        if trainer is not None:  # set-up done: the summary of the steps run
            summary = trainer.summary(interrupted=True)
    except Exception as err:  # noqa: BLE001 - any failure ends the run with its message and a summary
        if not isinstance(err, RUN_ERRORS):
            traceback.print_exc()
        print(f"\nerror: {err}", file=sys.stderr)
        if trainer is not None and trainer.step:
            print("\n=== run summary (failed) ===")
            failed = trainer.summary()
            for line in failed.lines():
                print(line)
            trainer.publish(failed, curves=False)
        return EXIT_FAILED
    finally:
        if trainer is not None:
            if summary is not None:  # finished or interrupted: the summary and curves.png to every logger
                curves = trainer.publish(summary)
            trainer.close()
        stop.uninstall()
        if own_ray:
            ray.shutdown()
    if summary is None:  # forced during set-up: the run stopped what it had started, no step ran
        by = f" by {stop.name}" if stop.requested else ""
        print(f"\n=== interrupted{by} during set-up: no step ran, no new checkpoint ===", flush=True)
        return stop.exit_code or EXIT_INTERRUPTED
    title = f"stopped by {stop.name}" if stop.requested else "interrupted"
    print(f"\n=== run summary{f' ({title})' if summary.interrupted else ''} ===")
    for line in summary.lines():
        print(line, flush=True)
    if curves is not None:
        print(f"curves       {curves}", flush=True)
    if summary.interrupted:
        return stop.exit_code or EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
