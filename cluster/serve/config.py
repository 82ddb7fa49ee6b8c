"""`python -m cluster.serve CONFIG`'s YAML: where it listens, who may call it, which base models it keeps.

    host: 127.0.0.1
    port: 8000                 # 0: a free port (the service prints the URL it serves)
    api_keys: [tml-local-1]    # the keys a caller may send (X-API-Key); the SDK wants the tml- prefix
    base_models:
      - name: tiny-gpt2        # what `create_lora_training_client(base_model=...)` names
        path: /models/tiny     # a local HF folder (model and tokenizer); nothing is downloaded
        warm: 0                # tenant actors started with the service, base loaded, waiting for a
                               # create_model (each holds tenant_cpus while it waits; cluster.serve.pool)
    lora_alpha: 32.0           # every tenant's LoRA alpha (its rank is the request's)
    lora_target_modules: all-linear
    seed: 0                    # a tenant's LoRA init seed when the request gives none
    torch_threads: 1           # per tenant actor
    zero_stage: 2              # each tenant's DeepSpeed ZeRO stage (2 or 3; the learner's default)
    tenant_cpus: 1.0           # Ray CPUs per tenant actor
    ray_address: local         # 'local' starts a Ray here; 'auto' joins the cluster this process runs in (a Ray
                               # job's: cluster.serve.submit passes --ray-address auto); an address joins that cluster
    start_timeout_s: 300       # a tenant's or sampler's actor must start (and load) within this (a
                               # create_model the cluster has no CPUs for is refused at once instead)
    call_timeout_s: 600        # one forward_backward / optim_step / sample must finish within this
    order_wait_s: 300          # a call waits this long for its seq_id predecessor, then fails
    session_timeout_s: 300     # a session with no heartbeat for this long is ended (its tenants and samplers
                               # released); the SDK heartbeats every 10 s, so at least 20 (two of them)
    checkpoint_dir: null       # a folder for named checkpoints (save_state, save_weights_for_sampler(name)),
                               # one subfolder per API key; null: they are refused
    rollout:                   # the rollout engine sampling clients run on (one per session and base model)
      engine: hf               # a name of rollout_workers.engines.ENGINES (hf, vllm)
      vllm: {}                 # rollout.vllm's options for engine vllm (e.g. max_lora_rank, kv_cache_gib)
    tracking:                  # each tenant's metrics, one tracker run per training client, one row per
      loggers: [jsonl]         # optim_step (cluster.serve.tenant_metrics); run.loggers' names but prometheus
      dir: runs/serve          # <dir>/<sha256(key)[:16]>/<model_id>/metrics.jsonl; wandb: / mlflow: as a run's

A wrong field is an error naming it and what it allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, field_validator, model_validator

from cluster.serve.tenant_metrics import TrackingSection
from kernel.strict import Strict
from learner.config import LearnerConfig
from rollout_workers.config import EngineName, RolloutConfig, VLLMConfig

SDK_HEARTBEAT_S = 10.0  # tinker/lib/internal_client_holder.py, SESSION_HEARTBEAT_PERIOD_SEC (tinker 0.38)
MIN_SESSION_TIMEOUT_S = 2 * SDK_HEARTBEAT_S  # one late or lost heartbeat never ends a live session


class BaseModelEntry(Strict):
    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    warm: int = Field(0, ge=0)  # the warm pool's size for this base model (cluster.serve.pool)


class SamplingRollout(Strict):
    """The rollout engine sampling clients run on: the training config's `rollout.engine` and `rollout.vllm`
    (their allowed values and rules are the rollout role's, `rollout_workers.engines.ENGINES`), so an
    error names the same fields here. The rest of the engine's section is fixed by the service
    (`ServeConfig.sampling_rollout`)."""

    engine: EngineName = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


class ServeConfig(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: list[str] = Field(min_length=1)
    base_models: list[BaseModelEntry] = Field(min_length=1)
    lora_alpha: float = Field(32.0, gt=0.0)
    lora_target_modules: list[str] | Literal["all-linear"] = "all-linear"
    seed: int = 0
    torch_threads: int = Field(1, ge=1)
    zero_stage: Literal[2, 3] = LearnerConfig.model_fields["zero_stage"].default
    tenant_cpus: float = Field(1.0, gt=0.0)
    ray_address: str = "local"
    start_timeout_s: float = Field(300.0, gt=0.0)
    call_timeout_s: float = Field(600.0, gt=0.0)
    order_wait_s: float = Field(300.0, gt=0.0)
    session_timeout_s: float = 300.0
    checkpoint_dir: str | None = None
    rollout: SamplingRollout = Field(default_factory=SamplingRollout)
    tracking: TrackingSection = Field(default_factory=TrackingSection)

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        bad = [k[:8] + "..." for k in keys if not k.startswith("tml-")]
        if bad:
            raise ValueError(f"api_keys must start with 'tml-' (the tinker SDK sends no other): {bad}")
        return keys

    @field_validator("session_timeout_s")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if not value >= MIN_SESSION_TIMEOUT_S:
            raise ValueError(
                f"session_timeout_s must be >= {MIN_SESSION_TIMEOUT_S:g} (got {value:g}): the tinker SDK sends a "
                f"heartbeat every {SDK_HEARTBEAT_S:g} s, and a shorter timeout would end live sessions"
            )
        return value

    @model_validator(mode="after")
    def _engine_rules(self) -> ServeConfig:
        self.sampling_rollout()  # the rollout role's rules on the engine's section (RolloutConfig's validators)
        return self

    def sampling_rollout(self) -> RolloutConfig:
        """The section a sampling engine is built from: the chosen engine and its vLLM options, adapters
        applied by the engine itself (`lora_sync: adapter`), float32 (the dtype the acknowledgement
        compares at), `torch_threads` threads; its LoRA room is fitted to the first snapshot it loads
        (`Engine.fit_adapters`, `cluster.serve.sampling`)."""
        return RolloutConfig(
            engine=self.rollout.engine, vllm=self.rollout.vllm, lora_sync="adapter", dtype="float32",
            torch_threads=self.torch_threads,
        )  # fmt: skip

    def base_model(self, name: str) -> BaseModelEntry:
        for entry in self.base_models:
            if entry.name == name:
                return entry
        raise ValueError(
            f"base_model {name!r} is not served here; served: {[e.name for e in self.base_models]}"
        )


def load_serve_config(path: str | Path) -> ServeConfig:
    tree = yaml.safe_load(Path(path).read_text()) or {}
    return ServeConfig.model_validate(tree)
