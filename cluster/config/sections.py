"""The run-level sections of the run schema (`cluster.config.schema.RunConfig` composes them with each
role's own section): run, model, cluster, timeouts, pipeline, checkpoint, eval (data: `data_section`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from cluster.config.pipelines import PIPELINES
from cluster.config.sinks import SINKS
from kernel.strict import Strict as _Strict


def check_loggers(names: list[str]) -> list[str]:
    """`names` if each is a registered sink, none twice and jsonl (the record) among them; else ValueError."""
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; allowed: {', '.join(SINKS.names())}")
    if len(set(names)) != len(names):
        raise ValueError(f"a logger is listed twice: {names}")
    if "jsonl" not in names:
        raise ValueError("'jsonl' must be listed: metrics.jsonl is the run's record (resume reads it)")
    return names


class WandbSection(_Strict):
    project: str = Field("rayppo", description="W&B project of the run.")
    entity: str | None = Field(None, description="W&B entity (user or team); none: the account's default.")
    mode: Literal["online", "offline"] | None = Field(
        None,
        description="'online', or 'offline' (the run folder's wandb/ holds the run: `wandb sync` it later); "
        "none: W&B's own choice (the WANDB_MODE environment variable, else online).",
    )
    tags: list[str] = Field(default_factory=list, description="Tags of the W&B run.")


class MlflowSection(_Strict):
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking server, e.g. http://127.0.0.1:5000; none: MLflow's own default "
        "(the MLFLOW_TRACKING_URI environment variable, else ./mlruns).",
    )
    experiment: str = Field("rayppo", description="MLflow experiment of the run (created when missing).")


class RunSection(_Strict):
    name: str = Field("run", description="Run name; the run folder is <output_dir>/<name>-<timestamp>.")
    output_dir: str = Field("runs", description="Parent folder of run folders.")
    seed: int = Field(0, description="Seed of data order, sampling and learner initialisation.")
    steps: int = Field(100, ge=1, description="PPO iterations (rollout batch -> update -> weight push).")
    sample_log_count: int = Field(4, ge=0, description="Sampled responses printed before and after training.")
    loggers: list[str] = Field(
        ["jsonl", "tensorboard", "prometheus"],
        description="Where the driver logs the run (cluster/config/sinks.py): " + SINKS.describe() + ".",
    )
    wandb: WandbSection = Field(default_factory=WandbSection, description="The 'wandb' logger.")
    mlflow: MlflowSection = Field(default_factory=MlflowSection, description="The 'mlflow' logger.")
    progress_bar: bool = Field(True, description="Show a progress bar on the driver.")

    @model_validator(mode="before")
    @classmethod
    def _no_tensorboard_flag(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tensorboard" in data:
            raise ValueError(
                "run.tensorboard was replaced by run.loggers: list 'tensorboard' there, or leave it out "
                "(e.g. run.loggers=[jsonl,prometheus])"
            )
        return data

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, names: list[str]) -> list[str]:
        return check_loggers(names)


class DemoAssetsSection(_Strict):
    demo: str = Field(
        ...,
        description="Which demo's assets (a module of the `demos` package): 'sentiment', 'arithmetic' or 'calculator'.",
    )
    folder: str = Field(..., description="Folder the assets are built into when missing or out of date.")

    @field_validator("demo")
    @classmethod
    def _known(cls, name: str) -> str:
        from cluster.demo_assets import known_demos

        if name not in known_demos():
            raise ValueError(f"unknown demo {name!r}; one of {', '.join(known_demos())}")
        return name


class ModelSection(_Strict):
    policy_path: str = Field(..., description="Initial policy folder (save_pretrained layout, local path).")
    tokenizer_path: str | None = Field(None, description="Tokenizer folder; defaults to policy_path.")
    demo_assets: DemoAssetsSection | None = Field(
        None, description="If set, build this demo's assets before the run when missing (see `demos`)."
    )


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
    dashboard_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Dashboard port of a local Ray. None: 8265, or the next free one when another run holds it "
        "(the run prints it). A port set here must be free: taken, the run stops before Ray starts.",
    )
    placement: Literal["separate", "colocated"] = Field(
        "separate",
        description="'separate': one Ray actor per role replica (each scales and fails on its own; needed by "
        "pipeline.mode='async'). 'colocated': one actor per learner rank also holding rollout worker, reference "
        "and reward replica i (a hybrid engine: one process and its devices shared by all roles, which take "
        "turns; sync pipeline only, fixed role counts; see cluster/placement/colocated.py).",
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
    mode: Literal[PIPELINES.names()] = Field("sync", description=PIPELINES.describe() + ".")
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
    partial_rollout: bool = Field(
        False,
        description="Async only: new weights reach a worker while it generates. At each publication every "
        "worker finishes its current decode step, loads the weights, recomputes the KV cache of its "
        "sequences and continues them (hf: between tokens; vLLM: between engine steps); each response "
        "token carries the version that sampled it and a sample's staleness is its oldest token's. Off: a "
        "worker loads new weights only between chunks.",
    )
    stale_policy: Literal["drop", "wait"] = Field(
        "drop",
        description="Async: what keeps samples within max_staleness when the learner takes a batch. 'drop': "
        "samples whose oldest token is more than max_staleness versions old are dropped and their prompts "
        "re-queued. 'wait': the learner waits for the chunks in flight that would be too old after its "
        "step and trains the oldest samples first, so none is ever dropped (it may idle longer).",
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
    prompts_path: str | list[str] | None = Field(
        None,
        description="Held-out prompts in any of data.prompts_path's forms, read and rendered like them (same "
        "prompt_key, meta_keys and chat template fields) and never trained on; None turns evaluation off.",
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
        description="Greedy decoding (top_k=1, on every engine) instead of sampling like the rollouts "
        "(rollout.sampling without its n).",
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Evaluate only the first N held-out prompts (None = all of them)."
    )
    correct_at: float = Field(
        1.0,
        description="A response counts as correct when its reward is at least this (reward >= correct_at; "
        "the rules exact_match and exact_integer score 1.0 right, 0.0 wrong): the definition behind "
        "eval/accuracy, eval/pass@k and eval/mean@n (reward.kind='rule' only).",
    )
    pass_k: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1],
        description="The k of each eval/pass@k metric (rule rewards): the unbiased estimate (Chen et al. 2021) "
        "from the n = samples_per_prompt responses of a prompt that at least one of k of them is correct, "
        "averaged over prompts; each k <= samples_per_prompt ([] = none).",
    )

    @field_validator("pass_k")
    @classmethod
    def _sorted(cls, ks: list[int]) -> list[int]:
        return sorted(set(ks))

    @model_validator(mode="after")
    def _pass_k_fits(self) -> EvalSection:
        too_big = [k for k in self.pass_k if k > self.samples_per_prompt]
        if too_big:
            raise ValueError(
                f"eval.pass_k: k={too_big[0]} needs at least k responses per prompt, but "
                f"eval.samples_per_prompt={self.samples_per_prompt} (allowed: 1 <= k <= samples_per_prompt)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.prompts_path is not None
