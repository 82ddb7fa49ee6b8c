"""One training run, whichever pipeline moves its data (`pipeline.mode`): set-up (roles, learner
ranks, prompts, loggers, the control actor; all in the constructor), checkpoints and resume, the step
loop with its progress bar, the final export and evaluation, and the summary.

The run owns no model and no pipeline machinery: it builds the pipeline `PIPELINES` names for the
mode and drives it through `cluster.pipeline.pipelines.Pipeline` (one call per step, its checkpoint
state, lost workers, the final catch-up). Its resumable state besides the learner's: step, policy
version, data position, and the pipeline's own.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml

from cluster.config.pipelines import PIPELINES
from cluster.config.schema import RunConfig
from cluster.pipeline.collector import RolloutCollector
from cluster.pipeline.control import NAMESPACE, RunControl, control_name, current_run_id
from cluster.pipeline.dynamic_sampling import resolve_filter
from cluster.pipeline.evaluation import Evaluator
from cluster.pipeline.learner_calls import LearnerRanks
from cluster.pipeline.pipelines import LearnerGate, Pipeline, RunParts, collector_for, replace_in_pool
from cluster.pipeline.progress import Checkpointer, RunProgress
from cluster.pipeline.stopping import StopRequest
from cluster.placement.gateway_book import GatewayBook
from cluster.placement.launch import Roles, launch_colocated, start_roles, stop_roles
from cluster.placement.plan import on_driver_node
from cluster.prompts.loader import (
    Prompt,
    PromptStream,
    RunPrompts,
    load_run_prompts,
    load_tokenizer,
    pad_token_id,
)
from cluster.prompts.prompting import save_tokenizer
from cluster.reporting.flat_groups import FlatGroupWatch
from cluster.reporting.folder import check_ranks_see_run_folder
from cluster.reporting.metrics import held_out_only, truncate_metrics
from cluster.reporting.reward_failures import RewardFailureLog
from cluster.reporting.startup_clock import StartupClock
from cluster.reporting.summary import RunSummary
from cluster.reporting.trackers.base import EVAL_AFTER, RUN, STARTUP, RunInfo, StepRow
from cluster.reporting.trackers.run_logger import RunLogger
from cluster.weights.publisher import WeightPublisher
from kernel.metric_names import merge_metrics

FIXED_COUNTS = (
    "this run uses cluster.placement='colocated': each rollout worker, reference and reward replica lives in "
    "a learner rank's process, so their counts are fixed (start the run with cluster.placement='separate' "
    "to scale roles while it trains)"
)


def pipeline_of(cfg: RunConfig) -> tuple[type[Pipeline], WeightPublisher]:
    """The pipeline class of `pipeline.mode` and its weight publisher, built before set-up (starting a
    worker brings it up to date); the pipeline itself is built at the end of set-up, from `RunParts`."""
    pipeline_class: type[Pipeline] = PIPELINES.function(cfg.pipeline.mode)
    return pipeline_class, pipeline_class.publisher(cfg)


class Run:
    """One run: set-up, checkpoints, the step loop, the final export and evaluation, the summary. Its
    collaborators: the pipeline of `pipeline.mode` (`pipeline`, built at the end of set-up), the weight
    publisher (`weights`, the pipeline's kind), the learner ranks (`learner`), the held-out evaluator
    (`evaluator`), the checkpointer (`checkpoints`) and the run's progress (`progress`).

    Complete once constructed: the constructor starts every actor, and a constructor that fails or is
    interrupted part-way (KeyboardInterrupt included) stops what it started before it re-raises, so no
    caller holds a half-built run. The caller owns the rest: `run = Run(...)`, then `try: ... finally:
    run.close()`."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        resume_from: Path | None = None,
        *,
        data: RunPrompts | None = None,
        clock: StartupClock | None = None,
        learner_gate: LearnerGate | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        """`data`: the prompts a preflight already read (`cluster.train`), else read here; `clock`: the
        start-up clock started before `ray.init`; `learner_gate`: see `RunParts.learner_gate`; `stop`: the
        stop request whose signal handlers the caller installed before set-up (`cluster.train`), else one
        of the run's own, not installed (`stop.request` asks it)."""
        self.cfg = cfg
        self.run_dir = Path(run_dir).resolve()  # the same folder for every actor, whatever its cwd
        self.resume_from = resume_from
        self.run_id = current_run_id(self.run_dir)
        self.progress = RunProgress()
        self.pipeline_class, self.weights = pipeline_of(cfg)
        self.pipeline: Pipeline | None = None  # built at the end of set-up
        self.checkpoints = Checkpointer(self.run_dir, cfg)
        self.roles: Roles | None = None
        self.log = RunLogger(cfg.run.loggers)  # opened at the end of set-up; the driver's only logger
        self.control: Any = None
        ds = cfg.data.dynamic_sampling
        self.group_filter = resolve_filter(ds.filter, ds.std_eps)  # None: dynamic sampling off
        self.resume_state: dict | None = None  # the checkpoint's run state when resuming
        self.t_start = time.perf_counter()
        self.clock = clock or StartupClock()
        self.stop = stop if stop is not None else StopRequest(cfg.checkpoint.stop_grace_s)
        self.data = data  # None: read in set-up
        self.learner_gate = learner_gate
        self.failures = RewardFailureLog(self.run_dir)  # reward failures: the first shown and kept
        self.flat_groups = FlatGroupWatch(cfg.learner.advantage)  # warns once when no group trains
        self.gateways = (  # agent.runners='external': where agents outside the cluster find the gateways
            GatewayBook(self.run_dir, self.run_id, cfg.agent.model_name, cfg.timeouts.actor_start_s)
            if cfg.agent.runners == "external"
            else None
        )
        try:
            self._start()
        except BaseException:  # failed or interrupted part-way: stop what started, then re-raise
            try:
                self.close()
            except Exception as err:  # noqa: BLE001 - the set-up's own error is the one to raise
                print(f"warning: stopping a run whose set-up failed: {err}", file=sys.stderr, flush=True)
            raise

    @property
    def version(self) -> int:
        """The weights published to the rollout workers (the learner's after `progress.step` steps)."""
        return self.weights.version

    @property
    def step(self) -> int:
        return self.progress.step

    # ------------------------------------------------------------------ set-up

    def _start(self) -> None:
        """Set-up, run by the constructor: the run folder and its config, the roles and learner ranks,
        the prompts, the control actor, the evaluator, the checkpoint resumed, the pipeline, the loggers."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        )
        if cfg.cluster.placement == "colocated":  # the hosts import and load while the driver tokenizes
            self.roles = launch_colocated(cfg, self.run_id)
        self.tokenizer = load_tokenizer(cfg)
        data = self.data
        if data is None:  # not handed over by `cluster.train`'s preflight, which announced its own
            data = load_run_prompts(cfg, self.tokenizer)
            data.announce(cfg)
        prompts, self.data_stats = data.train, data.stats
        self.prompts: list[Prompt] = prompts
        self.stream = PromptStream(prompts, cfg.run.seed, cfg.data.shuffle)
        pad = pad_token_id(self.tokenizer)
        self.roles = start_roles(cfg, pad, self.run_id, self._worker_started, launched=self.roles)
        for member in self.roles.workers.members:  # (colocated workers start inside their hosts)
            self._list_gateway(member.handle, member.name)
        self.weights.bind(self.roles, self.replace_lost_worker)
        self.learner = LearnerRanks(cfg, self.roles, self.checkpoints.resume_hint)
        check_ranks_see_run_folder(cfg, self.run_dir, self.roles.ranks, cfg.timeouts.actor_start_s)
        self.control = (
            ray.remote(RunControl)
            .options(
                name=control_name(self.run_id),
                namespace=NAMESPACE,
                num_cpus=0,
                get_if_exists=True,
                **on_driver_node(),
            )
            .remote(self._counts(), FIXED_COUNTS if self.roles.hosts else None)
        )
        self.evaluator = Evaluator(
            cfg,
            self.tokenizer,
            data.eval,
            prompts,
            lambda: collector_for(RolloutCollector, self.roles, cfg, self.weights),
            self.failures,
        )
        if self.resume_from is not None:
            self.restore(self.resume_from)
        parts = RunParts(
            cfg=cfg,
            roles=self.roles,
            learner=self.learner,
            weights=self.weights,
            stream=self.stream,
            prompts=prompts,
            evaluator=self.evaluator,
            progress=self.progress,
            data_stats=self.data_stats,
            group_filter=self.group_filter,
            failures=self.failures,
            learner_gate=self.learner_gate,
        )
        self.pipeline = self.pipeline_class(parts, self.resume_state)
        self.open_log()
        self.checkpoints.cadence.written()  # the minutes count from the end of set-up
        self.clock.mark("actors")
        if self.roles.hosts:
            self.clock.actor = ray.get(self.roles.hosts[0].startup_timings.remote(), timeout=60)

    def open_log(self) -> None:
        """Open the run's loggers, continuing the tracker runs the resumed checkpoint names, and keep the
        resolved config with them."""
        state = self.resume_state or {}
        self.log.open(
            RunInfo(
                name=self.cfg.run.name,
                run_id=self.run_id,
                run_dir=self.run_dir,
                config=self.cfg.model_dump(mode="json"),
                settings=self.cfg.run,
                resume_step=self.step if self.resume_state is not None else None,
                resume_ids=state.get("trackers", {}),
            )
        )
        self.log.artifact(self.run_dir / "config.yaml")

    def _counts(self) -> dict[str, int]:
        return {name: len(pool) for name, pool in self.roles.by_role.items()} | self.roles.group_counts()

    def close(self) -> None:
        """Stop what the run started (also what a set-up stopped part-way had started); twice is harmless."""
        if self.gateways is not None:
            self.gateways.close()
        self.log.close()
        if self.control is not None:
            ray.kill(self.control, no_restart=True)
        self.control = None
        if self.roles is not None:
            stop_roles(self.roles)
            self.roles = None

    # ------------------------------------------------------------------ checkpoints

    def extra_state(self) -> dict:
        """Run state saved with each checkpoint besides `progress` and the version: the prompt stream's
        position, the trackers' run ids and the pipeline's own state (the async buffer's)."""
        own = self.pipeline.state() if self.pipeline is not None else {}
        return {"stream": self.stream.state_dict(), "trackers": dict(self.log.ids), **own}

    def checkpoint(self) -> Path:
        """Write the checkpoint of the current step (once: a second call at the same step returns it)."""
        return self.checkpoints.save(self.roles.ranks, self.progress, self.version, self.extra_state())

    def restore(self, ckpt: Path) -> None:
        state = self.checkpoints.restore(ckpt, self.roles.ranks)
        self.resume_state = state
        self.progress.load_state_dict(state)
        self.stream.load_state_dict(state["stream"])
        self.sync_weights(int(state["version"]))
        # drop rows written after the checkpoint by the interrupted run
        rows = truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.progress.history = [
            {k: v for k, v in r.items() if k != "step"} for r in rows if not held_out_only(r)
        ]
        self.evaluator.before = next((r for r in rows if r["step"] == 0), None)  # the held-out 'before' row

    # ------------------------------------------------------------------ one iteration

    def _worker_started(self, handle: Any, name: str) -> None:
        """A new or replaced rollout worker: the current weights, and its gateway listed for external agents."""
        self.weights.bring_up_to_date(handle, name)
        self._list_gateway(handle, name)

    def _list_gateway(self, handle: Any, name: str) -> None:
        if self.gateways is not None:
            self.gateways.add(handle, name)

    def targets(self) -> dict[str, int]:
        """The pools' counts asked for through the control actor (`cluster.scale`)."""
        return ray.get(self.control.targets.remote(), timeout=30)

    def apply_scaling(self) -> list[str]:
        """Resize the pools to the control actor's counts now (the pipeline's rule); the events."""
        return self.pipeline.scale(self.targets())

    def sync_weights(self, version: int, members: list[Any] | None = None) -> float:
        """Push v`version` to `members` (every rollout worker when None); see `WeightPublisher.push`."""
        return self.weights.push(version, members)

    def replace_lost_worker(self, member: Any) -> None:
        """A worker lost during a push: the pipeline's rule (before it exists, on resume: replaced in
        place; its replacement loads the weights just pushed before it samples)."""
        if self.pipeline is None:
            replace_in_pool(self.roles, member)
        else:
            self.pipeline.replace_lost_worker(member)

    def iteration(self) -> dict[str, float]:
        """One learner step through the pipeline, then recorded everywhere (and checkpointed if due)."""
        step = self.progress.step + 1
        result = self.pipeline.step(step, self.targets())
        self.finish_step(step, result.metrics, result.worker_lags)
        return result.metrics

    def finish_step(self, step: int, metrics: dict[str, float], worker_lags: dict | None = None) -> None:
        """Record a finished step everywhere (the run's loggers, history); checkpoint if due.
        `worker_lags` (async): versions each rollout worker trails, exported per worker to Ray metrics."""
        stages = {f"weights/{s}": t for s, t in self.weights.take_stages().items()}
        metrics.update(merge_metrics(metrics, stages))  # in place: `iteration` returns this row
        self.log.step(StepRow(step, metrics, worker_lags=worker_lags or {}))
        self.flat_groups.observe(step, metrics)
        self.progress.history.append(metrics)
        if self.checkpoints.due(step):
            self.checkpoint()

    # ------------------------------------------------------------------ whole run

    def train(self) -> RunSummary:
        if self.step == 0:
            before = self.evaluator.report("before")
            if before is not None:
                self.log.step(StepRow(0, before, held_out_only=True))
            self.clock.mark("held-out eval")
        bar = None
        if self.cfg.run.progress_bar:
            from tqdm import tqdm

            bar = tqdm(
                total=self.cfg.run.steps, initial=self.step, desc="ppo", unit="step", dynamic_ncols=True
            )
        try:
            while self.step < self.cfg.run.steps and not self.stop.requested:
                m = self.iteration()
                if "step 1" not in self.clock.marks:
                    self.clock.mark("step 1")
                    self.clock.write(self.run_dir)
                    self.log.summary(STARTUP, self.clock.phases())
                    self.log.artifact(self.run_dir / "startup.json")
                if bar is not None:
                    bar.set_postfix(_postfix(m))
                    bar.update(1)
        except KeyboardInterrupt:  # forced: no new checkpoint, the last one stays resumable
            if bar is not None:
                bar.close()
            return self.summary(interrupted=True)
        if bar is not None:
            bar.close()
        if self.stop.requested:  # a safe point: the step is done
            self.stop.reached_safe_point()
            if self.step:
                self.checkpoint()
            return self.summary(interrupted=True)
        self.checkpoint()
        final_dir = self.run_dir / "final"
        # rank 0 writes all of final/ (policy, value head, tokenizer files), so it lands on one node
        ray.get(
            [r.save_pretrained.remote(str(final_dir), self.cfg.tokenizer_path) for r in self.roles.ranks],
            timeout=self.cfg.timeouts.train_s,
        )
        # how the prompts were rendered: the template, its kwargs and system prompt, and prompting.json
        save_tokenizer(self.cfg.data, self.cfg.tokenizer_path, final_dir)
        self.pipeline.workers_to_current()
        after = self.evaluator.report("after")
        if after is not None:  # the curves' last point (a row after the last step's) and the summary's
            self.log.step(StepRow(self.step, after, held_out_only=True))
            self.log.summary(EVAL_AFTER, after)
        return self.summary(final_dir=final_dir)

    def publish(self, summary: RunSummary, curves: bool = True) -> Path | None:
        """The run's summary to every logger and, with `curves`, curves.png drawn and logged (None without
        matplotlib, the 'plot' extra)."""
        self.log.summary(RUN, summary.scalars())
        if not curves or not self.log.opened:
            return None
        from cluster.reporting.curves import plot_run

        try:
            path = plot_run(self.run_dir)
        except ImportError:  # matplotlib is optional (the 'plot' extra)
            return None
        self.log.artifact(path)
        return path

    def summary(self, final_dir: Path | None = None, interrupted: bool = False) -> RunSummary:
        tail = self.progress.history[-5:]
        prob = [m["rollout/reward_prob_mean"] for m in tail if "rollout/reward_prob_mean" in m]
        return RunSummary(
            run_dir=str(self.run_dir),
            steps=self.step,
            samples=self.progress.samples_seen,
            wall_s=time.perf_counter() - self.t_start,
            final_reward=float(np.mean([m["rollout/reward_mean"] for m in tail])) if tail else math.nan,
            final_reward_prob=float(np.mean(prob)) if prob else None,
            final_kl=float(np.mean([m.get("objective/kl", math.nan) for m in tail])) if tail else math.nan,
            policy_path=str(final_dir) if final_dir else None,
            metrics_path=str(self.run_dir / "metrics.jsonl"),
            checkpoint=str(self.checkpoints.last) if self.checkpoints.last else None,
            interrupted=interrupted,
            extra=self.evaluator.summary_lines()
            + ([self.clock.line()] if "step 1" in self.clock.marks else []),
        )


def _postfix(m: dict[str, float]) -> dict[str, str]:
    post = {"reward_mean": f"{m['rollout/reward_mean']:.3f}", "kl": f"{m.get('objective/kl', math.nan):.3f}"}
    if "rollout/reward_prob_mean" in m:
        post["p_pos"] = f"{m['rollout/reward_prob_mean']:.3f}"
    return post
