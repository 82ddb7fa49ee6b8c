"""The run-level sections of the run schema (`cluster.config.schema.RunConfig` composes them with each
role's own section): run, model, data, cluster, timeouts, pipeline, checkpoint, eval."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.config.filters import check_filter_spec
from cluster.config.pipelines import PIPELINES
from cluster.config.sinks import SINKS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
        unknown = [n for n in names if n not in SINKS]
        if unknown:
            raise ValueError(f"unknown logger(s) {unknown}; allowed: {', '.join(SINKS.names())}")
        if len(set(names)) != len(names):
            raise ValueError(f"a logger is listed twice: {names}")
        if "jsonl" not in names:
            raise ValueError("'jsonl' must be listed: metrics.jsonl is the run's record (resume reads it)")
        return names


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


class DynamicSamplingSection(_Strict):
    filter: str = Field(
        "none",
        description="Which groups (the rollout.sampling.n samples of one prompt) are trained: 'none' (all: dynamic "
        "sampling off), 'nonzero_std' (only groups whose rewards' std exceeds std_eps: DAPO's dynamic sampling), or "
        "a user function 'package.module:function' / 'path/to/file.py:function' taking the group's successful "
        "rewards (a float64 array) and returning whether to keep it. A sample's reward is its return (a multi-turn "
        "episode's outcome plus its earlier turns' rewards with reward.kind='environment'), what grpo and rloo "
        "train on. Dropped groups are counted and the batch is refilled with more prompts; needs "
        "rollout.sampling.n >= 2.",
    )
    max_rounds: int = Field(
        8,
        ge=1,
        description="Sync: collect rounds per step (the first batch + refills of exactly the missing groups); "
        "async: a batch is taken short once the groups scored since the previous one (kept + filtered) reach "
        "max_rounds x data.prompts_per_step. Past it the step trains the informative groups it has (the rest "
        "counted in dynamic/shortfall_groups); with none at all the run stops with an error naming this field.",
    )
    std_eps: float = Field(
        1e-6, ge=0, description="'nonzero_std' keeps a group whose rewards' population std is > this."
    )

    @field_validator("filter")
    @classmethod
    def _known_filter(cls, spec: str) -> str:
        return check_filter_spec(spec)

    @property
    def enabled(self) -> bool:
        return self.filter != "none"


CHAT_TEMPLATE_KEYWORDS = ("auto", "none")  # data.chat_template's values that are not a Jinja file
# apply_chat_template arguments the data loader sets itself: data.chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
)


class DataSection(_Strict):
    prompts_path: str | list[str] = Field(
        ...,
        description="The prompts: a file (.jsonl: one object per line; .json: a list of objects; .parquet; "
        ".csv: a header line, every value a string), a folder saved by datasets' save_to_disk, a glob of them "
        "(sorted), or a list of any of these, read in order and concatenated. Each row's identity is its position in that concatenation (a JSONL file's "
        "line number, blank lines included). See docs/data.md.",
    )
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or a list of chat messages ({role: system|user|"
        "assistant|tool, content: string, optional tool_calls}) rendered with data.chat_template; a string "
        "holding such a list as JSON text (a CSV cell, an export's string column) is read as those messages "
        "and counted. Every other "
        "column of the row is the prompt's meta (handed to rule/remote rewards and environments).",
    )
    meta_keys: list[str] = Field(
        default_factory=list,
        description="Columns every row must have (checked when the prompts are read; a row without one is an "
        "error). Every column besides data.prompt_key reaches the reward as meta whether listed or not.",
    )
    prompts_per_step: int = Field(
        64, ge=1, description="Prompts per PPO iteration (rollout batch = this x sampling.n)."
    )
    max_prompt_tokens: int = Field(
        64,
        ge=1,
        description="Longest prompt in tokens, counted as the model sees it (BOS and, for chat prompts, the "
        "whole rendered template: system prompt, role markers and the generation prompt). It also sizes the "
        "engines' context (+ rollout.sampling.max_new_tokens): chat prompts usually need hundreds; "
        "`python -m cluster.data CONFIG` prints the lengths.",
    )
    long_prompt: Literal["truncate", "skip"] = Field(
        "truncate",
        description="Over-long plain-text prompts: keep the last tokens, or skip them (counted). Over-long "
        "chat prompts are always skipped and counted (never cut through the template).",
    )
    add_bos: bool = Field(
        True,
        description="Prepend the tokenizer's BOS token to plain-text prompts when it has one. Never added to a "
        "rendered chat prompt: its ids are the template's (a template that wants a BOS writes {{ bos_token }}).",
    )
    chat_template: str = Field(
        "auto",
        description="How chat-message prompts become tokens: 'auto' (the tokenizer's own chat template; a "
        "messages prompt with a tokenizer that has none is an error), 'none' (messages prompts are an error), "
        "or a path to a Jinja file used instead of the tokenizer's. Rendered with add_generation_prompt=True.",
    )
    system_prompt: str | None = Field(
        None, description="A system message put first in every chat prompt whose messages have none."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template (apply_chat_template's keyword arguments), e.g. "
        "{enable_thinking: false}.",
    )
    tools: list[str | dict[str, Any]] = Field(
        default_factory=list,
        description="Tools the chat template writes into the prompt (apply_chat_template's tools=), each "
        "'file.py:function' (a path from the current directory) or 'dotted.module:function' naming a typed "
        "Python function with a Google-style docstring (transformers' get_json_schema writes its JSON "
        "schema), or a schema given as is ({type: function, function: {name, description, parameters}}). "
        "Prompts and chat observations get the same schemas. See docs/data.md.",
    )
    wrap_string_prompts: bool = Field(
        False,
        description="A string prompt becomes one user message rendered with the chat template (instead of "
        "plain text).",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded).")
    dynamic_sampling: DynamicSamplingSection = Field(
        default_factory=DynamicSamplingSection,
        description="Drop groups whose rewards carry no signal and refill the batch with more prompts "
        "(off by default: filter='none').",
    )

    @field_validator("prompts_path")
    @classmethod
    def _some_path(cls, value: str | list[str]) -> str | list[str]:
        paths = [value] if isinstance(value, str) else value
        if not paths or any(not p.strip() for p in paths):
            raise ValueError(
                "give a file, folder or glob (or a non-empty list of them); empty paths are not allowed"
            )
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
        if taken:
            raise ValueError(
                f"{', '.join(taken)} set by the data loader (a prompt is rendered with add_generation_prompt=True, "
                "tokenize=True); keys allowed are the template's own variables, e.g. enable_thinking"
            )
        return kwargs

    @field_validator("tools")
    @classmethod
    def _tool_entries(cls, entries: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        for i, entry in enumerate(entries):
            if isinstance(entry, str):
                source, _, name = entry.rpartition(":")
                if not source.strip() or not name.strip():
                    raise ValueError(
                        f"[{i}] {entry!r}: give 'path/to/file.py:function' or 'dotted.module:function'"
                    )
            else:
                function = entry.get("function")
                if entry.get("type") != "function" or not (
                    isinstance(function, dict) and isinstance(function.get("name"), str)
                ):
                    raise ValueError(
                        f"[{i}]: a schema is {{type: function, function: {{name, description, parameters}}}}, "
                        f"got keys {sorted(entry)}"
                    )
        return entries

    @field_validator("chat_template")
    @classmethod
    def _template_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(f"give one of {', '.join(CHAT_TEMPLATE_KEYWORDS)} or a path to a Jinja file")
        return value

    @model_validator(mode="after")
    def _tools_given_once(self) -> DataSection:
        if self.tools and "tools" in self.chat_template_kwargs:
            raise ValueError(
                "data.tools and data.chat_template_kwargs.tools both give the template's tools: keep one "
                "(data.tools takes functions and schemas)"
            )
        return self

    @model_validator(mode="after")
    def _chat_fields_need_a_template(self) -> DataSection:
        if self.chat_template != "none":
            return self
        used = [
            name
            for name, on in (
                ("data.system_prompt", self.system_prompt is not None),
                ("data.chat_template_kwargs", bool(self.chat_template_kwargs)),
                ("data.tools", bool(self.tools)),
                ("data.wrap_string_prompts", self.wrap_string_prompts),
            )
            if on
        ]
        if used:
            raise ValueError(
                f"{', '.join(used)} apply to chat prompts, which data.chat_template='none' refuses: set "
                "data.chat_template to 'auto' or a Jinja file, or remove them"
            )
        return self

    @property
    def chat_template_file(self) -> str | None:
        """The Jinja file of data.chat_template, None for 'auto' and 'none'."""
        return None if self.chat_template in CHAT_TEMPLATE_KEYWORDS else self.chat_template


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
