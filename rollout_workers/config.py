"""Config section owned by the rollout role; `cluster.config` composes it into the run schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM engine.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="Fraction of GPU memory vLLM may take."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (slower, faster start).")


class RolloutConfig(_Strict):
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="Generation backend: 'hf' (transformers, CPU/GPU) or 'vllm' (GPU)."
    )
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
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights dtype for generation."
    )
    chunk_size: int = Field(
        16, ge=1, description="Prompts per generate call; finished chunks are scored while others generate."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="vLLM engine options (engine='vllm' only)."
    )
