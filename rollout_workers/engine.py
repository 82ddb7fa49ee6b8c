"""The generation-engine interface every backend implements (the factory and the registry of backends: `rollout_workers.engines`).

Backends only turn token ids into sampled token ids and behaviour logprobs. Prompt validation,
the seeding policy, version tagging and building `Sample` records live in `RolloutWorker`. The
sleep / wake-up contract (for an engine colocated with the learner) is stated and enforced here, in
`RolloutEngine`; the backends only free and restore memory.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kernel.sequences import pad_id_of
from rollout_workers.config import SamplingConfig
from rollout_workers.types import FinishReason
from rollout_workers.weights import sampled_digest, state_checksum


@dataclass
class GenerationOutput:
    """One sampled response. `logprobs[i]` is the log-probability of `response_ids[i]` under the
    distribution it was drawn from: log_softmax(logits / temperature), restricted to the top_k /
    top_p set and renormalised when those are on (every engine; vLLM's "processed_logprobs"). The
    off-policy weights π/μ (learner.off_policy) then use the true behaviour probability μ."""

    response_ids: np.ndarray  # int64 [r], r >= 1; ends with an EOS token iff finish_reason == "stop"
    logprobs: np.ndarray  # float32 [r]
    finish_reason: FinishReason
    # int64 [r]: `interrupt.version` when each token was sampled; None when generated without an interrupt
    versions: np.ndarray | None = None
    # uint8 [p + r - 1, layers, k] (rollout.record_routing, an MoE policy): the experts each MoE layer chose
    # for the prompt's tokens and the response's but its last (never forwarded); None: not recorded
    routing: np.ndarray | None = None


class Interrupt(Protocol):
    """How a generate call lets new weights in while it runs (`pipeline.partial_rollout`).

    At each interruption point (hf: before every sampled token; vLLM: at the call's start and between
    engine steps; so also before each turn of a multi-turn episode, each being a call) the engine
    asks `due()`; when True it drops every state computed with the old weights (KV cache, prefix
    cache, requests in flight), calls `swap()`, which returns once the new weights are loaded, and
    continues the same sequences from their token ids with the new weights: the KV cache of every
    token so far is recomputed (one prefill per sequence), so the logprobs of tokens sampled after the
    swap are those of the new weights. `version` tags each sampled token (`GenerationOutput.versions`).
    """

    @property
    def version(self) -> int: ...

    def due(self) -> bool: ...

    def swap(self) -> None: ...


class RolloutEngine(ABC):
    """A model that samples responses for token-id prompts and can swap its weights in place.

    The public methods state the contract every backend shares and enforce it; a backend implements
    the underscored hooks (`_generate`, `_probe_logprobs`, `_load_weights`, `_release`, `_restore`; and
    `_load_adapter`, `_held_adapter` for an engine that applies LoRA adapters itself).

    Sleep (for an engine sharing its devices with the learner, as in a hybrid engine): `sleep(level)`
    frees what the engine holds on its device while the learner trains, `wake_up()` takes it back.
    - level 1: the weights move to host memory and the KV cache is dropped; after `wake_up()` the engine
      computes exactly what it computed before (same seed -> same samples).
    - level 2: the weights and KV cache are discarded; after `wake_up()` the weights are unknown and
      `generate` / `probe_logprobs` raise until `load_weights` succeeds (a backend may keep a host copy,
      the contract does not promise it).
    - `sleep` on a sleeping engine and `wake_up` on an awake one are no-ops that return False (a second
      `sleep` does not change the level the engine fell asleep at).
    - While asleep, `generate`, `probe_logprobs` and `load_weights` raise RuntimeError ("engine is asleep:
      wake_up() first"): vLLM cannot write into weights it has offloaded or discarded, so the order is
      learner step -> `wake_up()` -> `load_weights` -> `generate`.
    - A hook that raises leaves the state as it was (a failed `wake_up` can be retried).
    """

    name: str = "engine"

    # Set by each backend's constructor; read by the worker to validate prompts and outputs.
    dtype: torch.dtype  # weights dtype used for generation (checksums are taken at this dtype)
    vocab_size: int  # valid token ids are 0 .. vocab_size-1
    max_model_len: int | None  # longest prompt + response the model supports (None: no fixed limit)
    eos_token_ids: frozenset[int]  # tokens that end a response with finish_reason 'stop'

    _sleep_level: int = 0  # 0: awake; 1 or 2: the level the engine fell asleep at
    _unknown_weights: str | None = None  # why the weights held are unknown (None: they are known)

    def generate(
        self,
        prompts: list[np.ndarray],
        sampling: SamplingConfig,
        seed: int,
        stop_ids: frozenset[int] = frozenset(),
        max_new_tokens: list[int] | None = None,
        interrupt: Interrupt | None = None,
    ) -> list[list[GenerationOutput]]:
        """Sample `sampling.n` responses per prompt: outer list follows `prompts`, inner has n entries.

        Prompts are already validated (non-empty int64 ids in vocab, fit in `max_model_len`). The same
        prompts, sampling, seed and weights give the same outputs. A response ends at an EOS token or
        at one of `stop_ids` (both kept, finish_reason 'stop'), or after `max_new_tokens[i]` tokens for
        prompt i (default `sampling.max_new_tokens` for all; finish_reason 'length'). With neither
        argument given the outputs are those of a plain call: the multi-turn rollout's first turn
        reproduces a single-turn generation. With an `interrupt` (see `Interrupt`) new weights may be
        swapped in between tokens; while none is due the outputs are those of a call without one.
        """
        self._require_ready()
        limits = [sampling.max_new_tokens] * len(prompts) if max_new_tokens is None else list(max_new_tokens)
        if len(limits) != len(prompts) or any(not 1 <= m <= sampling.max_new_tokens for m in limits):
            raise ValueError(
                f"max_new_tokens must give 1..{sampling.max_new_tokens} for each of {len(prompts)} prompts"
            )
        return self._generate(prompts, sampling, seed, frozenset(stop_ids), limits, interrupt)

    def probe_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        """Teacher-forced logprobs (temperature 1, float32 [L-1]) of tokens 1..L-1 of each sequence,
        computed by this engine's own forward on the weights it holds: the functional fingerprint
        that acknowledges a weight swap (see `kernel.sequences.probe_sequences`)."""
        self._require_ready()
        return self._probe_logprobs(sequences)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the weights in place; raise (naming the keys) when `state` does not fit the model.

        A refused bundle changes nothing; a load that fails part-way leaves the weights unknown (the
        backend sets `_unknown_weights`) until a full load succeeds."""
        if self.is_sleeping:
            raise RuntimeError(f"{self.name} engine is asleep: wake_up() first, then load the weights")
        self._load_weights(state)
        self._unknown_weights = None

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """Apply a LoRA adapter bundle on the engine's base weights (`rollout.lora_sync: adapter`; the
        format: `rollout_workers.adapter`); raise (naming the keys) when it does not fit the model or
        the adapter loaded before. The same contract as `load_weights`: a refused bundle changes
        nothing, a load that fails part-way leaves the weights unknown. An engine without adapter
        support raises NotImplementedError naming itself."""
        if self.is_sleeping:
            raise RuntimeError(f"{self.name} engine is asleep: wake_up() first, then load the adapter")
        self._load_adapter(state)
        self._unknown_weights = None

    # Whether `adapter_digest` names tensors as the adapter bundles do (then it equals the bundle's
    # `sampled_digest` after a load); else it is only comparable with the engine's own earlier digests.
    adapter_names_match: bool = True

    def adapter_digest(self) -> str:
        """`sampled_digest` of the adapter as the engine holds it, at the engine dtype; under the bundle's
        names (equal to the bundle's after `load_adapter`) where `adapter_names_match`."""
        return sampled_digest(self._held_adapter().items(), self.dtype)

    def adapter_checksum(self) -> str | None:
        """`state_checksum` of the adapter held (equal to `state_checksum(bundle, self.dtype)` after a load);
        None for an engine that cannot read it back under the bundle's names."""
        return state_checksum(self._held_adapter(), self.dtype)

    # Processes that join the learner's weight group for this engine (`join_weight_group`): the
    # worker's own for hf, one per tensor-parallel rank for vLLM (its worker processes).
    weight_receivers: int = 1

    def join_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float, backend: str
    ) -> None:
        """Join learner rank 0's weight group (`learner.weight_broadcast`) at host:port with group ranks
        `first_rank .. first_rank + weight_receivers - 1`, in the processes holding the weights."""
        self._join_weight_group(host, port, first_rank, world_size, timeout_s, backend)

    def receive_weights(self, min_version: int) -> tuple[int, str]:
        """Load the next broadcast bundle bucket by bucket, straight into the weights; returns (its
        version, the `sampled_digest` of what arrived). The same contract as `load_weights`: a bundle
        older than `min_version` or that does not fit is refused (read to its end, nothing changed), a
        load that fails part-way leaves the weights unknown. A failed broadcast raises
        `WeightGroupError`; the group must then be joined again."""
        if self.is_sleeping:
            raise RuntimeError(f"{self.name} engine is asleep: wake_up() first, then load the weights")
        version, digest = self._receive_weights(min_version)
        self._unknown_weights = None
        return version, digest

    # Whether `weights_digest` names tensors as the bundles do (then it equals the bundle's
    # `sampled_digest` after a load); else it is only comparable with the engine's own earlier digests.
    digest_names_match: bool = True

    @abstractmethod
    def weights_digest(self) -> str:
        """`rollout_workers.weights.sampled_digest` of the weights as the engine holds them now, computed
        where they live (for vLLM inside its worker processes)."""

    @abstractmethod
    def weights_checksum(self) -> str | None:
        """`state_checksum(held, self.dtype)` of the weights held now, keyed like the bundles
        `load_weights` takes, so it equals `state_checksum(bundle, self.dtype)` after a load; None for
        an engine that cannot read its weights back under those names (vLLM fuses and repacks them)."""

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_level > 0

    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level the engine fell asleep at."""
        return self._sleep_level

    def sleep(self, level: int = 1) -> bool:
        """Free the engine's device memory at `level` (1 or 2, see the class docstring); True if it fell
        asleep now, False if it already slept."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.is_sleeping:
            return False
        self._release(level)
        self._sleep_level = level
        return True

    def wake_up(self) -> bool:
        """Take the device memory back; True if it woke now, False if it was awake. After a level-2
        sleep the weights must be loaded before the engine generates again."""
        level = self._sleep_level
        if not level:
            return False
        self._restore(level)
        self._sleep_level = 0
        if level == 2:
            self._unknown_weights = "the engine woke from a level-2 sleep, which discards the weights"
        return True

    @property
    def ready(self) -> bool:
        """Awake and holding known weights: `generate` and `probe_logprobs` would not raise."""
        return not self.is_sleeping and self._unknown_weights is None

    def _require_ready(self) -> None:
        if self.is_sleeping:
            raise RuntimeError(f"{self.name} engine is asleep: wake_up() first")
        if self._unknown_weights is not None:
            raise RuntimeError(f"{self._unknown_weights}: the weights are unknown until a full bundle loads")

    # Backend hooks: called by the public methods above once the contract's checks pass.
    @abstractmethod
    def _generate(
        self,
        prompts: list[np.ndarray],
        sampling: SamplingConfig,
        seed: int,
        stop_ids: frozenset[int],
        limits: list[int],
        interrupt: Interrupt | None = None,
    ) -> list[list[GenerationOutput]]:
        """`generate` with every argument resolved: `limits[i]` tokens at most for prompt i."""

    @abstractmethod
    def _probe_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]: ...

    @abstractmethod
    def _load_weights(self, state: dict[str, torch.Tensor]) -> None: ...

    def _load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError(
            f"the {self.name} engine does not apply LoRA adapters: use rollout.lora_sync='merged'"
        )

    def _held_adapter(self) -> dict[str, torch.Tensor]:
        """The adapter held, under the bundle's names (`adapter_digest`, `adapter_checksum`)."""
        raise NotImplementedError(f"the {self.name} engine holds no LoRA adapter")

    @abstractmethod
    def _join_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float, backend: str
    ) -> None: ...

    @abstractmethod
    def _receive_weights(self, min_version: int) -> tuple[int, str]: ...

    @abstractmethod
    def _release(self, level: int) -> None:
        """Free device memory for a sleep at `level` (1 or 2); called only on an awake engine."""

    @abstractmethod
    def _restore(self, level: int) -> None:
        """Undo `_release(level)`; called only on a sleeping engine."""


def read_special_ids(model_path: str) -> tuple[frozenset[int], int]:
    """(EOS ids, pad id) of a checkpoint: EOS from the tokenizer and the generation config together,
    so every backend stops on the same tokens. The pad id is the tokenizer's by the rule the driver
    gives the learner (`kernel.sequences.pad_id_of`); pads only fill masked positions."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    try:
        gen_eos = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: the model config's own eos_token_id
        gen_eos = getattr(AutoConfig.from_pretrained(model_path, local_files_only=True), "eos_token_id", None)
    eos = frozenset(_as_ids(tokenizer.eos_token_id) | _as_ids(gen_eos))
    if not eos:
        raise ValueError(f"{model_path}: neither the tokenizer nor the generation config names an EOS token")
    return eos, pad_id_of(tokenizer)


def _as_ids(x: int | list[int] | None) -> set[int]:
    if x is None:
        return set()
    return {int(v) for v in x} if isinstance(x, list | tuple) else {int(x)}


def finish_reason(ids: Any, stops: frozenset[int]) -> FinishReason:
    """The contract's finish reason of a response `ids`: "stop" iff it ends with a stop token (vLLM says
    'length' when the EOS is also the max_tokens-th token; the contract keys on the token)."""
    return "stop" if len(ids) and int(ids[-1]) in stops else "length"


def derive_seed(seed: int, *keys: int) -> int:
    """A 62-bit seed from `seed` and integer keys (e.g. a prompt's position), for per-request RNGs.

    Leaves headroom below 2**63 so engines may add small offsets (vLLM adds the sample index).
    """
    payload = ",".join(str(int(x)) for x in (seed, *keys)).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little") >> 2
