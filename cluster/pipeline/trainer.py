"""The synchronous PPO loop: prompts -> rollout -> scoring -> learner -> weight push.

The trainer owns no model; it moves records between roles, times every phase, applies scaling
requests between iterations, and keeps the only state needed to resume besides the learner's own
(step, policy version, data position).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml

from cluster.config.schema import RunConfig
from cluster.pipeline.chat import save_tokenizer
from cluster.pipeline.chunks import Parts, RolloutBatch, env_errors, reward_errors
from cluster.pipeline.collector import RolloutCollector
from cluster.pipeline.control import NAMESPACE, RunControl, control_name, current_run_id
from cluster.pipeline.data import (
    Prompt,
    PromptStream,
    RunPrompts,
    load_run_prompts,
    load_tokenizer,
    pad_token_id,
)
from cluster.pipeline.dynamic_sampling import StepAccount, resolve_filter, round_seed, split_chunk
from cluster.pipeline.evaluation import Evaluator
from cluster.pipeline.learner_calls import LearnerRanks
from cluster.pipeline.progress import Checkpointer, RunProgress
from cluster.pipeline.stopping import StopRequest
from cluster.placement.actors import Roles, launch_colocated, start_roles, stop_roles
from cluster.placement.plan import on_driver_node
from cluster.run.folder import check_ranks_see_run_folder
from cluster.run.metrics import SyncStepTimes, held_out_only, sync_step_metrics, truncate_metrics
from cluster.run.startup import StartupClock
from cluster.run.summary import RunSummary
from cluster.run.trackers.base import EVAL_AFTER, RUN, STARTUP, RunInfo, StepRow
from cluster.run.trackers.run_logger import RunLogger
from cluster.weights.publisher import WeightPublisher

FIXED_COUNTS = (
    "this run uses cluster.placement='colocated': each rollout worker, reference and reward replica lives in "
    "a learner rank's process, so their counts are fixed (start the run with cluster.placement='separate' "
    "to scale roles while it trains)"
)


class RewardFailureError(RuntimeError):
    """Too many rewards of one step failed (reward.max_failure_frac)."""


class EnvironmentFailureError(RuntimeError):
    """Too many episodes of one step failed in their environment (rollout.environment.max_failure_frac)."""


class Trainer:
    """The sync pipeline (`pipeline.mode: sync`), and the run both pipelines share: set-up, scaling,
    learner steps, checkpoints, the whole run and its summary. Its collaborators: the rollout
    collector (`collector`), the weight publisher (`weights`), the held-out evaluator (`evaluator`),
    the checkpointer (`checkpoints`) and the run's progress (`progress`)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, resume_from: Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir).resolve()  # the same folder for every actor, whatever its cwd
        self.resume_from = resume_from
        self.run_id = current_run_id(self.run_dir)
        self.progress = RunProgress()
        self.weights = self.make_publisher()
        self.checkpoints = Checkpointer(self.run_dir, cfg)
        self.roles: Roles | None = None
        self.log = RunLogger(cfg.run.loggers)  # opened at the end of set-up; the driver's only logger
        self.control: Any = None
        ds = cfg.data.dynamic_sampling
        self.group_filter = resolve_filter(ds.filter, ds.std_eps)  # None: dynamic sampling off
        self.resume_state: dict | None = None  # the checkpoint's run state when resuming
        self.t_start = time.perf_counter()
        self.clock = StartupClock()  # `train.main` hands over the one it started before ray.init
        self.stop = StopRequest(cfg.checkpoint.stop_grace_s)  # `train.main` installs its signal handlers
        self.data: RunPrompts | None = None  # `train.main` hands over the prompts its preflight read

    def make_publisher(self) -> WeightPublisher:
        return WeightPublisher(self.cfg)

    @property
    def version(self) -> int:
        """The weights published to the rollout workers (the learner's after `progress.step` steps)."""
        return self.weights.version

    @property
    def step(self) -> int:
        return self.progress.step

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(
            yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
        )
        if cfg.cluster.placement == "colocated":  # the hosts import and load while the driver tokenizes
            self.roles = launch_colocated(cfg, self.run_id)
        self.tokenizer = load_tokenizer(cfg)
        data = self.data or load_run_prompts(cfg, self.tokenizer)
        prompts, self.data_stats = data.train, data.stats
        self.prompts: list[Prompt] = prompts
        self.stream = PromptStream(prompts, cfg.run.seed, cfg.data.shuffle)
        pad = pad_token_id(self.tokenizer)
        self.roles = start_roles(cfg, pad, self.run_id, self.weights.bring_up_to_date, launched=self.roles)
        self.weights.bind(self.roles, self.replace_lost_worker)
        self.learner = LearnerRanks(cfg, self.roles, self.checkpoints.resume_hint)
        check_ranks_see_run_folder(cfg, self.run_dir, self.roles.ranks, cfg.timeouts.actor_start_s)
        self.collector = self.make_collector(RolloutCollector)
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
            cfg, self.tokenizer, data.eval, prompts, lambda: self.make_collector(RolloutCollector)
        )
        if self.resume_from is not None:
            self.restore(self.resume_from)
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

    def make_collector(self, cls: type[RolloutCollector]) -> RolloutCollector:
        """A collector of `cls` over this run's pools, timeouts and replacement hook."""
        return cls(
            self.roles.by_role,
            self.cfg.timeouts,
            prepare=self.weights.prepare,
            one_chunk_per_worker=bool(self.roles.hosts),
        )

    def _counts(self) -> dict[str, int]:
        return {name: len(pool) for name, pool in self.roles.by_role.items()}

    def close(self) -> None:
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
        position (the async pipeline adds its buffer's)."""
        return {"stream": self.stream.state_dict(), "trackers": dict(self.log.ids)}

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

    def apply_scaling(self) -> list[str]:
        targets = ray.get(self.control.targets.remote(), timeout=30)
        events = []
        for role, want in targets.items():
            added, removed = self.roles.by_role[role].resize(int(want))
            events += [f"+{n}" for n in added] + [f"-{n}" for n in removed]
        return events

    def sync_weights(self, version: int, members: list[Any] | None = None) -> float:
        """Push v`version` to `members` (every rollout worker when None); see `WeightPublisher.push`."""
        return self.weights.push(version, members)

    def replace_lost_worker(self, member: Any) -> None:
        """A worker lost during a push: its replacement loads the weights just pushed before it samples."""
        self.roles.workers.replace(self.roles.workers.names.index(member.name))

    def iteration(self) -> dict[str, float]:
        cfg, progress = self.cfg, self.progress
        t0 = time.perf_counter()
        step = progress.step + 1
        scaling = self.apply_scaling()
        account = None
        if self.group_filter is None:
            prompts = self.stream.next_batch(cfg.data.prompts_per_step)
            batch = self.collector.collect(prompts, step, cfg.run.seed, cfg.rollout.chunk_size)
            self.check_failures(step, batch.parts, batch.total)
        else:
            batch, account = self.collect_informative(step)
        t1 = time.perf_counter()
        learner_metrics = self.learner.learn(batch, step, self.collector.regather)
        t_train = time.perf_counter() - t1
        t_sync = self.sync_weights(step)
        progress.step = step
        kept = batch.kept
        progress.samples_seen += len(kept)
        progress.record_batch(batch.parts)
        times = SyncStepTimes(train=t_train, weight_sync=t_sync, wall=time.perf_counter() - t0)
        metrics = sync_step_metrics(
            batch,
            learner_metrics,
            times,
            self.data_stats,
            cfg.reward,
            self.version,
            len(self.roles.workers),
            self.weights.replacements,
        )
        metrics["scale/events"] = float(len(scaling))
        if account is not None:
            progress.record_filtered(account.filtered_prompts)
            metrics.update(account.metrics())
            metrics["dynamic/filtered_total"] = float(progress.filtered_total)
        if self.evaluator.due(step):
            metrics.update(self.evaluator.evaluate()[0])
        self.finish_step(step, metrics)
        return metrics

    def collect_informative(self, step: int) -> tuple[RolloutBatch, StepAccount]:
        """Dynamic sampling, sync: collect, drop the groups the filter refuses, draw exactly the missing
        number of prompts and collect again (round r's chunk seeds come from `round_seed`), until the
        batch holds data.prompts_per_step groups or max_rounds rounds ran. Every drawn prompt is either
        in the returned batch or in the account's filtered prompts; none is carried to the next step."""
        cfg, ds = self.cfg, self.cfg.data.dynamic_sampling
        account = StepAccount(cfg.data.prompts_per_step)
        merged = RolloutBatch(selected={})
        want = account.target
        while True:
            prompts = self.stream.next_batch(want)
            seed = round_seed(cfg.run.seed, account.rounds)
            got = self.collector.collect(prompts, step, seed, cfg.rollout.chunk_size)
            self.check_failures(step, got.parts, got.total)
            kept_groups, filtered = 0, []
            for chunk in got.chunks:
                kept_pos, dropped = split_chunk(chunk, self.group_filter)
                filtered += dropped
                if not kept_pos:
                    continue
                kept_groups += len(kept_pos)
                chunk.index = len(merged.chunks)  # unique within the merged batch (regather finds it)
                merged.chunks.append(chunk)
                merged.selected[chunk.index] = sorted(j for pos in kept_pos.values() for j in pos)
            account.record_round(len(prompts), kept_groups, filtered)
            merged.count_in(got)
            if account.finished(ds.max_rounds):
                break
            want = account.next_draw()
        account.check_trainable(ds.max_rounds)
        return merged, account

    def finish_step(self, step: int, metrics: dict[str, float], worker_lags: dict | None = None) -> None:
        """Record a finished step everywhere (the run's loggers, history); checkpoint if due.
        `worker_lags` (async): versions each rollout worker trails, exported per worker to Ray metrics."""
        metrics.update({f"weights/{stage}": s for stage, s in self.weights.take_stages().items()})
        self.log.step(StepRow(step, metrics, worker_lags=worker_lags or {}))
        self.progress.history.append(metrics)
        if self.checkpoints.due(step):
            self.checkpoint()

    def check_failures(self, step: int, parts: Parts, total: int) -> None:
        """Abort the step when more than reward.max_failure_frac of its `total` samples' rewards failed,
        or more than rollout.environment.max_failure_frac of its episodes' environments failed."""
        for errors, frac, field, what, error in (
            (
                reward_errors(parts),
                self.cfg.reward.max_failure_frac,
                "reward.max_failure_frac",
                "rewards",
                RewardFailureError,
            ),
            (
                env_errors(parts),
                self.cfg.rollout.environment.max_failure_frac,
                "rollout.environment.max_failure_frac",
                "episodes' environments",
                EnvironmentFailureError,
            ),
        ):
            if len(errors) > frac * total:
                raise error(
                    f"step {step}: {len(errors)}/{total} {what} failed (> {field}="
                    f"{frac}); first errors: {errors[:3]}"
                )

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
        if self.cfg.data.chat_template_file:  # the Jinja file the prompts were rendered with
            save_tokenizer(self.cfg.data, self.cfg.tokenizer_path, final_dir)
        self.workers_to_current()
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
        from cluster.plot import plot_run

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

    def workers_to_current(self) -> None:
        """Every rollout worker holds the newest weights (sync mode pushes them each step)."""


def _postfix(m: dict[str, float]) -> dict[str, str]:
    post = {"reward_mean": f"{m['rollout/reward_mean']:.3f}", "kl": f"{m.get('objective/kl', math.nan):.3f}"}
    if "rollout/reward_prob_mean" in m:
        post["p_pos"] = f"{m['rollout/reward_prob_mean']:.3f}"
    return post
