"""The run schema: each role's own section composed with the run-level ones, loaded from YAML.

Every field is typed, has its default here and a one-line description; unknown keys and wrong
types are rejected with the dotted path of the field (`ConfigError`, exit code 2 in the CLI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from learner.config import LearnerConfig
from reward_service.config import ReferenceConfig, RewardConfig
from rollout_workers.config import RolloutConfig

RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class ConfigError(ValueError):
    """A config that cannot run; the message names the field or file."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(_Strict):
    name: str = Field("run", description="Run name; the run folder is <output_dir>/<name>-<timestamp>.")
    output_dir: str = Field("runs", description="Parent folder of run folders.")
    seed: int = Field(0, description="Seed of data order, sampling and learner initialisation.")
    steps: int = Field(100, ge=1, description="PPO iterations (rollout batch -> update -> weight push).")
    sample_log_count: int = Field(4, ge=0, description="Sampled responses printed before and after training.")
    tensorboard: bool = Field(
        True, description="Also write TensorBoard events (if tensorboard is installed)."
    )
    progress_bar: bool = Field(True, description="Show a progress bar on the controller.")


class DemoAssetsSection(_Strict):
    demo: str = Field(
        ..., description="Which demo's assets (a module of the `demos` package): 'sentiment' or 'arithmetic'."
    )
    folder: str = Field(..., description="Folder the assets are built into when missing or out of date.")

    @field_validator("demo")
    @classmethod
    def _known(cls, name: str) -> str:
        from demos import DEMOS

        if name not in DEMOS:
            raise ValueError(f"unknown demo {name!r}; one of {', '.join(sorted(DEMOS))}")
        return name


class ModelSection(_Strict):
    policy_path: str = Field(..., description="Initial policy folder (save_pretrained layout, local path).")
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; defaults to policy_path.")
    demo_assets: DemoAssetsSection | None = Field(
        None, description="If set, build this demo's assets before the run when missing (see `demos`)."
    )


class DataSection(_Strict):
    prompts_path: str = Field(..., description="JSONL file of prompts, one object per line.")
    prompt_key: str = Field("prompt", description="Key of the prompt text in each JSONL object.")
    meta_keys: list[str] = Field(
        default_factory=list, description="Extra JSONL keys passed to rule rewards as meta."
    )
    prompts_per_step: int = Field(
        64, ge=1, description="Prompts per PPO iteration (rollout batch = this x sampling.n)."
    )
    max_prompt_tokens: int = Field(64, ge=1, description="Longest prompt in tokens.")
    long_prompt: Literal["truncate", "skip"] = Field(
        "truncate", description="Over-long prompts: keep the last tokens, or skip them (counted)."
    )
    add_bos: bool = Field(True, description="Prepend the tokenizer's BOS token when it has one.")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded).")


class ClusterSection(_Strict):
    address: str | None = Field(
        None, description="Ray address ('auto', ray://host:10001); None starts a local Ray."
    )
    num_cpus: float | None = Field(
        None,
        gt=0,
        description="Logical CPUs of a local Ray (None = what the actors need, at least the cores).",
    )
    num_gpus: int | None = Field(None, ge=0, description="GPUs of a local Ray (None = detect).")
    dashboard: bool = Field(True, description="Start the Ray dashboard with a local Ray.")
    dashboard_host: str = Field(
        "127.0.0.1",
        description="Dashboard bind address; the job API runs arbitrary code, keep it on loopback.",
    )
    dashboard_port: int = Field(8265, ge=1, le=65535, description="Dashboard port.")
    placement: Literal["separate", "colocated"] = Field(
        "separate",
        description="'separate': one Ray actor per role replica (each scales and fails on its own; needed by "
        "pipeline.mode='async'). 'colocated': one actor per learner rank also holding rollout worker, reference "
        "and reward replica i (a hybrid engine: one process and its devices shared by all roles, which take "
        "turns; sync pipeline only, fixed role counts; see cluster/colocated.py).",
    )
    autoscaling: bool = Field(
        False,
        description="The cluster adds nodes for pending work (Ray autoscaler, KubeRay): a placement plan the "
        "current nodes cannot hold waits up to timeouts.actor_start_s for new nodes instead of failing at once.",
    )


class TimeoutSection(_Strict):
    actor_start_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for the placement plan on a busy cluster, and for actors to start and load models.",
    )
    generate_s: float = Field(600.0, gt=0, description="Longest wait for one generate call.")
    score_s: float = Field(600.0, gt=0, description="Longest wait for one reference or reward call.")
    train_s: float = Field(1800.0, gt=0, description="Longest wait for one learner step.")
    weight_sync_s: float = Field(600.0, gt=0, description="Longest wait for exporting and loading weights.")


class PipelineSection(_Strict):
    mode: Literal["sync", "async"] = Field(
        "sync",
        description=(
            "'sync': each step generates a whole batch, trains, pushes weights (lock-step). 'async': "
            "workers stream chunks while the learner trains; staleness bounded by max_staleness."
        ),
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description=(
            "eta: a sample trained at learner version v was generated by version >= v - eta (async). "
            "Enforced at admission (generation throttled) and at consumption (older samples dropped, "
            "their prompts re-queued)."
        ),
    )
    max_inflight_per_worker: int = Field(
        1,
        ge=1,
        description="Generate calls queued on one rollout worker at once (async); a call's deadline starts when it runs.",
    )


class CheckpointSection(_Strict):
    every_steps: int = Field(
        0, ge=0, description="Checkpoint every N steps (0 = no step cadence; every_minutes still applies)."
    )
    every_minutes: float = Field(
        30.0,
        ge=0,
        description="Checkpoint at the end of the first step that ends this many minutes after the last "
        "checkpoint (or the start): bounds the work a crash loses (0 = off).",
    )
    keep_last: int = Field(2, ge=1, description="Newest complete checkpoints kept; older ones are deleted.")
    keep_best: int = Field(
        0, ge=0, description="Also keep the K checkpoints with the best best_metric (0 = off)."
    )
    best_metric: str = Field(
        "rollout/reward_mean",
        description="Step metric (a metrics.jsonl key) that ranks checkpoints for keep_best.",
    )
    best_mode: Literal["max", "min"] = Field(
        "max", description="Whether a higher or lower best_metric is better."
    )
    stop_grace_s: float = Field(
        600.0,
        gt=0,
        description="After SIGTERM/SIGINT the current learner step may finish within this many seconds, then a "
        "checkpoint is written; past it (or on a second signal) the run stops without one.",
    )


class EvalSection(_Strict):
    prompts_path: str | None = Field(
        None,
        description="JSONL of held-out prompts, read like data.prompts_path (same prompt_key and meta_keys) "
        "and never trained on; None turns evaluation off.",
    )
    every_steps: int = Field(
        10,
        ge=0,
        description="Evaluate with the current weights after every N steps, besides before the first and "
        "after the last step (0 = only before and after).",
    )
    samples_per_prompt: int = Field(1, ge=1, description="Responses drawn per held-out prompt.")
    greedy: bool = Field(
        False,
        description="Greedy decoding (top_k=1; engine='hf') instead of sampling like the rollouts "
        "(rollout.sampling without its n).",
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Evaluate only the first N held-out prompts (None = all of them)."
    )
    correct_at: float = Field(
        1.0,
        description="A response counts as correct for eval/accuracy when its reward is at least this "
        "(reward.kind='rule' only).",
    )

    @property
    def enabled(self) -> bool:
        return self.prompts_path is not None


class RunConfig(_Strict):
    run: RunSection = Field(default_factory=RunSection, description="Run-level settings.")
    model: ModelSection = Field(..., description="Policy and tokenizer.")
    data: DataSection = Field(..., description="Prompt data.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout workers.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward scorer.")
    reference: ReferenceConfig = Field(
        default_factory=ReferenceConfig, description="Frozen reference policy."
    )
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="DeepSpeed learner.")
    cluster: ClusterSection = Field(default_factory=ClusterSection, description="Ray cluster connection.")
    timeouts: TimeoutSection = Field(default_factory=TimeoutSection, description="Remote call timeouts.")
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="Checkpoints and resume."
    )
    pipeline: PipelineSection = Field(
        default_factory=PipelineSection, description="Synchronous or streaming (async) data plane."
    )
    eval: EvalSection = Field(
        default_factory=EvalSection, description="Held-out evaluation during training (off without prompts)."
    )

    @model_validator(mode="after")
    def _combinations(self) -> RunConfig:
        samples = self.data.prompts_per_step * self.rollout.sampling.n
        per_rank = samples // self.learner.num_ranks
        if per_rank < 1:
            raise ValueError(
                f"learner.num_ranks={self.learner.num_ranks} is more than the {samples} samples per step "
                "(data.prompts_per_step x rollout.sampling.n)"
            )
        if self.learner.num_minibatches > per_rank:
            raise ValueError(
                f"learner.num_minibatches={self.learner.num_minibatches} makes minibatches smaller than one "
                f"sample: each rank gets {per_rank} samples per step"
            )
        if self.learner.advantage in ("grpo", "rloo") and self.rollout.sampling.n < 2:
            raise ValueError(
                f"learner.advantage={self.learner.advantage!r} takes its baseline from the other samples of "
                "the same prompt: set rollout.sampling.n >= 2"
            )
        stale = self.pipeline.mode == "async" and self.pipeline.max_staleness > 0
        if self.learner.advantage == "vtrace" and self.learner.off_policy == "auto":
            self.learner.off_policy = "none"  # vtrace's truncated importance weights are the correction
        if self.learner.off_policy == "auto":
            # A correction is on whenever behaviour and proximal logprobs can differ: stale samples,
            # or a generator whose numerics differ from the learner's (e.g. a bf16 engine).
            mismatch = self.rollout.dtype != self.learner.dtype
            self.learner.off_policy = "tis" if stale or mismatch else "none"
        if stale and self.learner.off_policy == "none" and self.learner.advantage != "vtrace":
            raise ValueError(
                f"pipeline.mode='async' with pipeline.max_staleness={self.pipeline.max_staleness} trains on samples "
                "from older policies: set learner.off_policy to 'tis', 'mask' or 'geo_mask' (the PPO ratio is "
                "taken against the learner's proximal policy; this corrects for the behaviour policy), or "
                "pipeline.max_staleness=0"
            )
        if self.rollout.weight_sync == "collective" and self.pipeline.mode != "sync":
            raise ValueError(
                "rollout.weight_sync='collective' broadcasts to every worker at once: it needs "
                "pipeline.mode='sync' (async workers swap weights one by one between chunks)"
            )
        if self.eval.greedy and self.eval.enabled and self.rollout.engine != "hf":
            raise ValueError(
                "eval.greedy=true decodes with top_k=1, which rollout.engine='vllm' refuses: set eval.greedy=false"
            )
        if self.reward.kind == "model" and not self.reward.model_path:
            raise ValueError("reward.model_path is required when reward.kind='model'")
        if self.reward.kind == "rule" and not self.reward.rule:
            raise ValueError("reward.rule is required when reward.kind='rule'")
        if self.reward.kind == "remote" and not self.reward.url:
            raise ValueError("reward.url is required when reward.kind='remote'")
        return self

    @model_validator(mode="after")
    def _colocated(self) -> RunConfig:
        """What cluster.placement='colocated' cannot do, named with the field to change."""
        if self.cluster.placement != "colocated":
            if self.rollout.sleep_level:
                raise ValueError(
                    f"rollout.sleep_level={self.rollout.sleep_level} frees the engine's memory for a learner on the "
                    "same devices: it needs cluster.placement='colocated' (set 0 with 'separate')"
                )
            return self
        ranks = self.learner.num_ranks
        problems = [
            (self.pipeline.mode != "sync", "pipeline.mode='async' (the roles take turns in one process)"),
            (
                self.rollout.weight_sync != "object_store",
                "rollout.weight_sync='collective' (weights move in memory)",
            ),
            (
                self.rollout.engine == "vllm"
                and self.rollout.vllm.tensor_parallel_size > 1
                and self.rollout.num_gpus_per_worker > 0,
                "rollout.vllm.tensor_parallel_size > 1 on GPUs (an engine of its own placement group)",
            ),
            *(
                (
                    count > ranks,
                    f"{name}={count} > learner.num_ranks={ranks} (replica i lives on learner rank i)",
                )
                for name, count in (
                    ("rollout.num_workers", self.rollout.num_workers),
                    ("reference.num_replicas", self.reference.num_replicas),
                    ("reward.num_replicas", self.reward.num_replicas),
                )
            ),
            *(
                (bool(amounts), f"{name} (roles run where the learner ranks run: use learner.resources)")
                for name, amounts in (
                    ("rollout.resources", self.rollout.resources),
                    ("reference.resources", self.reference.resources),
                    ("reward.resources", self.reward.resources),
                )
            ),
        ]
        bad = [text for hit, text in problems if hit]
        if bad:
            raise ValueError(
                "cluster.placement='colocated' does not allow " + "; ".join(bad) + " (or use 'separate')"
            )
        return self

    @model_validator(mode="after")
    def _role_resources(self) -> RunConfig:
        """Custom resources: positive amounts, and never the ones Ray sets through num_cpus/num_gpus."""
        by_field = {
            "learner.resources": self.learner.resources,
            "rollout.resources": self.rollout.resources,
            "reference.resources": self.reference.resources,
            "reward.resources": self.reward.resources,
        }
        for field, amounts in by_field.items():
            for name, amount in amounts.items():
                if name in RAY_BUILTIN_RESOURCES:
                    raise ValueError(
                        f"{field}: {name!r} is set by the role's num_cpus/num_gpus fields; custom resources "
                        f"name node types, e.g. {{'{field.split('.')[0]}_node': 1}}"
                    )
                if not amount > 0:
                    raise ValueError(f"{field}.{name}: must be > 0 (got {amount})")
        return self

    @property
    def tokenizer_path(self) -> str:
        return self.model.tokenizer_path or self.model.policy_path

    @property
    def reference_path(self) -> str:
        return self.reference.model_path or self.model.policy_path


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML scalars (so 3, 1e-4, true, null work)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. learner.lr=1e-5")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"--set {item!r}: empty key")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return tree


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"  {path}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def build_config(tree: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return build_config(apply_overrides(tree, overrides or []))
