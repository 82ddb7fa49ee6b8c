"""Config section owned by the rollout role; `cluster.config` composes it into the run schema."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kernel.strict import Strict as _Strict
from rollout_workers.engines import ENGINES

EngineName = Literal[ENGINES.names()]  # the registered engines (rollout_workers.engines)
# rollout.weight_transport's values; cluster.weights.transport_choice chooses among them
WeightTransport = Literal["auto", "broadcast", "shared_memory", "cuda_ipc"]


class SamplingConfig(_Strict):
    temperature: float = Field(
        1.0, gt=0.0, description="Softmax temperature; the learner divides logits by it too."
    )
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = off).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1.0 = off).")
    max_new_tokens: int = Field(
        24, ge=1, description="Longest response in tokens; longer ones finish with 'length'."
    )
    n: int = Field(1, ge=1, description="Samples drawn per prompt.")


class VLLMConfig(_Strict):
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Devices per vLLM engine. On GPU with > 1 the worker actor holds no GPU itself: its "
        "engine's Ray workers take one GPU each from a placement group of this many bundles.",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory vLLM may take (weights + KV cache) when kv_cache_gib is unset.",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0.0,
        description="KV cache size in GiB (vLLM kv_cache_memory_bytes). None: sized by "
        "gpu_memory_utilization on GPU, 0.25 GiB on CPU (where that fraction would be of all RAM).",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Longest prompt + response the engine reserves KV cache for. None: "
        "data.max_prompt_tokens + sampling.max_new_tokens when the cluster starts the worker, "
        "else the model's own limit.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Skip CUDA graphs / torch.compile. None: True on CPU (compiling adds ~40 s of "
        "start-up there), False on GPU.",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="The largest LoRA rank the engine reserves room for (rollout.lora_sync='adapter'; rounded up to "
        "a size vLLM accepts: 1, 8, 16, 32, 64, ...). None: learner.lora.rank, set by the cluster.",
    )
    in_process: bool | None = Field(
        None,
        description="Run vLLM's engine core inside the worker process (VLLM_ENABLE_V1_MULTIPROCESSING=0). "
        "None: True on CPU (half the memory, a fraction of the start-up), False on GPU.",
    )


class GatewayConfig(_Strict):
    """The OpenAI-compatible endpoint a rollout worker serves to agents (rollout_workers/gateway/)."""

    host: str = Field(
        "127.0.0.1", description="Address the worker's gateway listens on ('0.0.0.0': every interface)."
    )
    port: int = Field(0, ge=0, le=65535, description="Its port (0: a free one, reported when it starts).")
    call_format: Literal["hermes"] = Field(
        "hermes",
        description="How the policy writes tool calls, parsed into OpenAI tool_calls: 'hermes' = "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5, Hermes).',
    )
    on_history_break: Literal["split", "refuse"] = Field(
        "split",
        description="A call whose messages do not extend the session's previous call and its answer (history "
        "dropped, edited or summarised; or a chat template that rewrites earlier turns): 'split' starts a new "
        "sample sharing the session's reward, 'refuse' answers 400 (code history_rewritten). Counted either way.",
    )
    max_sessions: int = Field(
        256, ge=1, description="Open sessions per worker; one more is refused with 429."
    )
    session_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="A session's deadline from its opening; past it its calls get 404 and it ends as timed out.",
    )
    batch_window_ms: float = Field(
        5.0,
        ge=0.0,
        description="How long the first request of an idle engine waits for others to batch with.",
    )
    max_batch: int = Field(64, ge=1, description="Most calls generated in one engine call.")
    max_total_tokens: int = Field(
        512,
        ge=2,
        description="Longest session sample: its first prompt, every completion and what came between. A call "
        "whose prompt and max_tokens would pass it is refused (400, context_length_exceeded).",
    )
    chat_template: str | None = Field(
        None,
        description="The Jinja template prompts are rendered with; None: the tokenizer's. Filled in by the cluster from data.chat_template.",
    )
    chat_template_kwargs: dict = Field(
        default_factory=dict,
        description="apply_chat_template arguments (filled in by the cluster from data.chat_template_kwargs).",
    )


class EnvironmentConfig(_Strict):
    name: str | None = Field(
        None,
        description="Registered environment for multi-turn rollouts (rollout_workers.environment): the built-in "
        "'tools' (tool calls answered by registered tools, a final answer checked against meta) or one a "
        "user module registers. None: one response per prompt, no environment.",
    )
    module: str | None = Field(
        None,
        description="Module imported on every rollout worker before the environment is built, so its "
        "@register_environment / @register_tool decorators run: a .py file (its text travels to the workers with "
        "the config) or a dotted module importable on the workers.",
    )
    module_source: str | None = Field(
        None,
        description="The text of `module` when it is a .py file, filled in by the cluster so that workers on "
        "any node run it without the file; leave unset.",
    )
    kwargs: dict = Field(default_factory=dict, description="Keyword arguments the environment is built with.")
    placement: Literal["worker", "actors"] = Field(
        "worker",
        description="Where environments run: 'worker' (inside each rollout worker: cheap, pure-Python ones) or "
        "'actors' (num_replicas Ray actors of their own, each episode on one: slow or unsafe environments; an "
        "actor whose call passes timeout_s is killed and restarted, its episodes fail). Either way each call "
        "runs on its own thread with its own deadline.",
    )
    num_replicas: int = Field(1, ge=1, description="Environment actors (placement='actors').")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs per environment actor (placement='actors').")
    max_turns: int = Field(
        4,
        ge=1,
        description="Model turns per episode; an episode still running after "
        "them ends with status 'max_turns'.",
    )
    max_total_tokens: int = Field(
        256,
        ge=2,
        description="Longest episode in tokens: prompt + every model turn + every observation. A turn is "
        "cut where it would pass it, and an observation that does not fit ends the episode ('max_tokens').",
    )
    turn_max_new_tokens: int | None = Field(
        None, ge=1, description="Longest model turn in tokens. None: rollout.sampling.max_new_tokens."
    )
    stop_strings: list[str] = Field(
        default_factory=list,
        description="Texts that end a model turn (e.g. a tool call's closing tag '</calc>'), besides EOS. Each "
        "must be one token of the policy's tokenizer (checked when the worker starts): turns stop on token "
        "ids, the same in every engine.",
    )
    observation_format: Literal["text", "chat"] = Field(
        "text",
        description="How an observation joins the episode: 'text' (its text tokenised as is, for base models "
        "and plain-text prompts) or 'chat' (rendered by the policy's chat template as a message of "
        "observation_role, closing the model's turn and opening the next assistant turn, appended token-wise: "
        "rollout_workers/chat_turns.py; the template must preserve the prefix).",
    )
    observation_role: str = Field(
        "tool", description="observation_format='chat': the role of observation messages ('tool' or 'user')."
    )
    chat_template: str | None = Field(
        None,
        description="observation_format='chat': the Jinja text of the template, filled in by the cluster from "
        "data.chat_template when that names a file (the prompts' template); leave unset. None: the tokenizer's.",
    )
    chat_template_kwargs: dict = Field(
        default_factory=dict,
        description="observation_format='chat': the template's extra variables, filled in by the cluster from "
        "data.chat_template_kwargs and data.tools (as their JSON schemas, tools=); leave unset.",
    )
    timeout_s: float = Field(
        30.0, gt=0, description="Deadline of each environment call (reset or step), from the call's start."
    )
    max_failure_frac: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="Abort the run when more than this fraction of a step's episodes fail (the environment "
        "raised or timed out). Failed episodes are dropped and counted (env/status/env_error, "
        "env/status/env_timeout, env/failures), never scored.",
    )

    @property
    def enabled(self) -> bool:
        return self.name is not None


class RolloutConfig(_Strict):
    engine: EngineName = Field("hf", description=f"Generation backend: {ENGINES.describe()}.")
    num_workers: int = Field(
        1, ge=1, description="Rollout worker actors; scale independently of the learner."
    )
    num_cpus_per_worker: float = Field(
        0.5, gt=0.0, description="Ray CPUs per rollout worker (fractions allowed)."
    )
    num_gpus_per_worker: float = Field(
        0.0, ge=0.0, description="Ray GPUs per rollout worker (fractions allowed)."
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads inside each worker.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each rollout worker needs besides CPUs/GPUs, to pin it to node types: {'rollout_node': 1} runs it only on nodes started with `ray start --resources` naming rollout_node; {'node:<ip>': 0.01} pins it to one node. Empty: any node.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype for generation."
    )
    chunk_size: int = Field(
        16,
        ge=1,
        description="Prompts per generate call; finished chunks are scored while others generate. (The "
        "cluster's colocated placement splits each batch evenly over its workers instead.)",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig,
        description="Multi-turn rollouts with an environment (off unless `name` is set).",
    )
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig,
        description="The OpenAI-compatible endpoint each worker serves when agents drive the rollouts.",
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="vLLM engine options (engine='vllm' only)."
    )
    weight_sync: Literal["object_store", "collective"] = Field(
        "object_store",
        description="How new weights reach the workers: 'object_store' (learner rank 0's bundle put once, "
        "every worker loads it) or 'collective' (learner rank 0 broadcasts bucket by bucket to a group of "
        "every process holding an engine's weights, vLLM's worker processes included; gloo, NCCL when "
        "learner and workers have GPUs). In pipeline.mode='async' the broadcast reaches all workers at once: "
        "when a step's weights are due, the chunks in flight finish, no new one starts until the broadcast is "
        "done.",
    )
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="With learner.lora: what a weight push carries. 'merged': the full weights with the adapter "
        "merged in (W + B A alpha/r), loaded as without LoRA (every engine). 'adapter': the adapter alone "
        "(lora_A, lora_B and modules_to_save: megabytes, not the model); the engine keeps its base weights and "
        "applies it (hf through PEFT; vLLM through its own LoRA support, for models it has LoRA for and without "
        "modules_to_save: docs/lora.md). Needs weight_sync='object_store'.",
    )
    weight_transport: WeightTransport = Field(
        "auto",
        description="With weight_sync='collective': how a bundle reaches the group. 'broadcast': every byte "
        "over the group (gloo or NCCL), from learner rank 0 after it gathered the bundle. 'shared_memory': "
        "every learner rank writes its part (its ZeRO-3 partitions, nothing gathered) into a /dev/shm segment "
        "that every member maps, and only the header is broadcast; needs every learner rank and worker on one "
        "node with CPU weights and room in its /dev/shm. 'cuda_ipc': learner rank 0 writes the bundle into a "
        "CUDA buffer on its device and every member maps it by its IPC handle, only the header is broadcast "
        "(over gloo: NCCL refuses two ranks on one device); needs GPU weights (learner.num_gpus_per_rank and "
        "rollout.num_gpus_per_worker > 0) with every learner rank and worker on one node and one CUDA device "
        "(not run on a GPU yet). 'auto': cuda_ipc where that holds, else shared_memory where that holds, else "
        "broadcast. An explicit transport that cannot apply is refused when the group forms.",
    )
    weight_bucket_mb: float = Field(
        64.0,
        gt=0.0,
        description="Bucket size of the collective weight broadcast: a receiver holds about one bucket "
        "beyond its weights while loading.",
    )
    probe_every: int | Literal["auto"] = Field(
        "auto",
        description="Which weight pushes also compare logprobs (learner rank 0 and every engine score the fixed "
        "probe sequences: a forward pass on both sides); every push checks digests of the weights, which refuse "
        "a stale or partial load on any version, and every worker's first push is probed. An int N probes "
        "v`version` when version % N == 0 (1: every push). 'auto' keeps the probe to 2% of the run's wall "
        "time: after a probed push whose probe took c seconds the next is due c/0.02 seconds later (on 2 CPU "
        "cores about every 3rd push of the 1M demo; on a GPU often).",
    )

    @field_validator("probe_every")
    @classmethod
    def _probe_every_positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be 'auto' or an int >= 1, got {v}")
        return v

    interruptible: bool = Field(
        False,
        description="Let a weight load cut into a running generate call at the engine's next interruption "
        "point (hf: between tokens; vLLM: between engine steps); the sequences continue from their ids with "
        "the new weights, each token tagged with its version. Set by the cluster from "
        "pipeline.partial_rollout; off: a load waits for the call to end.",
    )
    record_routing: bool = Field(
        False,
        description="Record, for a mixture-of-experts policy, the experts each MoE layer chose for every "
        "token of each sample (prompt and response, the last response token excepted: the engine never "
        "forwards it), uint8 [tokens, layers, top_k] on the sample (`Sample.routing`), for rollout routing "
        "replay (docs/moe.md). hf engine only; refused for a model without MoE layers and for multi-turn "
        "environments.",
    )
    sleep_level: Literal[0, 1, 2] = Field(
        0,
        description="What the engine frees between generations while the learner trains on the same devices "
        "(colocated placement). Unset: 1 when the cluster colocates the roles on GPUs, else 0. 0: never sleeps (separate placement, or CPU). 1: weights "
        "offloaded to host memory and KV cache dropped (vLLM sleep level 1; hf: the model moves to the CPU "
        "when it sits on a GPU). 2: weights and KV cache discarded (vLLM sleep level 2); the next weight "
        "push restores them. vLLM is built with enable_sleep_mode when > 0, which needs a CUDA/ROCm/XPU GPU.",
    )

    @model_validator(mode="after")
    def _lora_sync(self) -> RolloutConfig:
        if self.lora_sync != "adapter":
            return self
        if not ENGINES[self.engine].adapters:
            able = [e.name for e in ENGINES if e.adapters]
            raise ValueError(
                f"rollout.lora_sync='adapter' needs an engine that applies LoRA adapters itself ({able}); "
                f"rollout.engine={self.engine!r} takes the merged weights: set rollout.lora_sync='merged' "
                "(docs/lora.md)"
            )
        if self.weight_sync != "object_store":
            raise ValueError(
                "rollout.lora_sync='adapter' needs rollout.weight_sync='object_store': the collective broadcast "
                "carries full weights (the adapter is megabytes; the object store moves it once)"
            )
        return self

    @model_validator(mode="after")
    def _cuda_ipc_on_gpus(self) -> RolloutConfig:
        if self.weight_transport == "cuda_ipc" and not self.num_gpus_per_worker:
            raise ValueError(
                "rollout.weight_transport='cuda_ipc' maps the learner's CUDA buffer into the workers: it needs "
                "rollout.num_gpus_per_worker > 0 (CPU workers: 'auto', 'shared_memory' or 'broadcast')"
            )
        return self

    @model_validator(mode="after")
    def _record_routing(self) -> RolloutConfig:
        if not self.record_routing:
            return self
        why = ENGINES[self.engine].no_routing
        if why is not None:
            raise ValueError(f"rollout.record_routing with rollout.engine={self.engine!r}: {why}")
        if self.environment.enabled:
            raise ValueError(
                "rollout.record_routing with rollout.environment: multi-turn samples carry observation tokens "
                "the engine never routes as one sequence; recording is for single-turn samples"
            )
        return self

    @model_validator(mode="after")
    def _engine_rules(self) -> RolloutConfig:
        """The rules the engine's entry puts on this section (`Engine.check`), e.g. vLLM's GPUs per worker."""
        ENGINES[self.engine].check(self)
        return self
