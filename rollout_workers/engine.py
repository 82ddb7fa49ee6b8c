"""The generation-engine interface every backend implements, and the factory that picks one.

Backends only turn token ids into sampled token ids and behaviour logprobs. Prompt validation,
the seeding policy, version tagging and building `Sample` records live in `RolloutWorker`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.types import FinishReason


@dataclass
class GenerationOutput:
    """One sampled response; `logprobs[i]` = log_softmax(logits / temperature)[response_ids[i]]."""

    response_ids: np.ndarray  # int64 [r], r >= 1; ends with an EOS token iff finish_reason == "stop"
    logprobs: np.ndarray  # float32 [r]
    finish_reason: FinishReason


class RolloutEngine(ABC):
    """A model that samples responses for token-id prompts and can swap its weights in place."""

    name: str = "engine"

    # Set by each backend's constructor; read by the worker to validate prompts and outputs.
    dtype: torch.dtype  # weights dtype used for generation (checksums are taken at this dtype)
    vocab_size: int  # valid token ids are 0 .. vocab_size-1
    max_model_len: int | None  # longest prompt + response the model supports (None: no fixed limit)
    eos_token_ids: frozenset[int]  # tokens that end a response with finish_reason 'stop'

    @abstractmethod
    def generate(
        self, prompts: list[np.ndarray], sampling: SamplingConfig, seed: int
    ) -> list[list[GenerationOutput]]:
        """Sample `sampling.n` responses per prompt: outer list follows `prompts`, inner has n entries.

        Prompts are already validated (non-empty int64 ids in vocab, fit in `max_model_len`). The same
        prompts, sampling, seed and weights give the same outputs.
        """

    @abstractmethod
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the weights in place; raise (naming the keys) when `state` does not fit the model."""

    @abstractmethod
    def weights_checksum(self) -> str | None:
        """`state_checksum(held, self.dtype)` of the weights held now, keyed like the bundles
        `load_weights` takes, so it equals `state_checksum(bundle, self.dtype)` after a load; None for
        an engine that cannot read its weights back under those names (vLLM fuses and repacks them)."""

    @abstractmethod
    def probe_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        """Teacher-forced logprobs (temperature 1, float32 [L-1]) of tokens 1..L-1 of each sequence,
        computed by this engine's own forward on the weights it holds: the functional fingerprint
        that acknowledges a weight swap (see `learner.sequences.probe_sequences`)."""


def read_special_ids(model_path: str) -> tuple[frozenset[int], int]:
    """(EOS ids, pad id) of a checkpoint: EOS from the tokenizer and the generation config together,
    so every backend stops on the same tokens. Pads only fill masked positions, so the pad falls back
    to an EOS id when the tokenizer has none."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: the model config's own eos_token_id
        gen_eos = getattr(AutoConfig.from_pretrained(model_path, local_files_only=True), "eos_token_id", None)
    eos = frozenset(_as_ids(tokenizer.eos_token_id) | _as_ids(gen_eos))
    if not eos:
        raise ValueError(f"{model_path}: neither the tokenizer nor the generation config names an EOS token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return eos, int(pad)


def _as_ids(x: int | list[int] | None) -> set[int]:
    if x is None:
        return set()
    return {int(v) for v in x} if isinstance(x, list | tuple) else {int(x)}


def derive_seed(seed: int, *keys: int) -> int:
    """A 62-bit seed from `seed` and integer keys (e.g. a prompt's position), for per-request RNGs.

    Leaves headroom below 2**63 so engines may add small offsets (vLLM adds the sample index).
    """
    payload = ",".join(str(int(x)) for x in (seed, *keys)).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") >> 2


def make_engine(model_path: str, config: RolloutConfig) -> RolloutEngine:
    """Build the backend named by `config.engine` (imports it lazily: vLLM is an optional extra)."""
    if config.engine == "hf":
        from rollout_workers.hf_engine import HFEngine

        return HFEngine(model_path, config)
    if config.engine == "vllm":
        from rollout_workers.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, config)
    raise ValueError(f"unknown rollout engine {config.engine!r}; expected 'hf' or 'vllm'")
