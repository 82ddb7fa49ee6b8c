"""A rollout worker's gateway: its tokenizer and template, its engine calls, served over HTTP."""

from __future__ import annotations

from typing import Any

from rollout_workers.gateway.batcher import BatchKey
from rollout_workers.gateway.gateway import Gateway
from rollout_workers.gateway.server import GatewayServer


def serve_worker(worker: Any, model_name: str) -> GatewayServer:
    """Start `worker`'s gateway (a `RolloutWorker`: its `generate_ids`, config and engine limits)."""
    from transformers import AutoTokenizer

    config = worker.config
    tokenizer = AutoTokenizer.from_pretrained(worker.model_path, local_files_only=True)
    sampling = config.sampling

    def run(prompts, key: BatchKey, limits: list[int]):
        seed = key.seed if key.seed is not None else worker.gateway_seed()
        return worker.generate_ids(
            prompts, sampling.model_copy(update={"n": key.n}), seed, key.stop_ids, limits
        )

    engine = worker.engine_limits()
    gateway = Gateway(
        tokenizer,
        model_name,
        sampling,
        config.gateway,
        run,
        engine["eos_ids"],
        engine["max_model_len"],
        config.gateway.chat_template,
        config.gateway.chat_template_kwargs,
    )
    return GatewayServer(gateway, config.gateway.host, config.gateway.port)
