"""The frozen reference policy: per-token log-probabilities of sampled responses for the KL penalty."""

from __future__ import annotations

import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kernel.sequences import (
    check_packing_exact,
    fused_gelu_kwargs,
    pack_rows,
    pack_sequences,
    packed_response_logits,
    pad_id_of,
    response_logits,
    response_tokens,
)
from learner.algorithms import logprobs_from_logits
from reward_service.config import ReferenceConfig
from reward_service.hf_models import DTYPES


def pick_device() -> torch.device:
    """A GPU when Ray (or the user) left one visible to this process, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class ReferencePolicy:
    """Scores responses under the initial policy, with the sampling temperature applied as everywhere else.

    A plain class: `cluster/` wraps it with `ray.remote`; tests call it directly.
    """

    def __init__(
        self, model_path: str, config: ReferenceConfig, temperature: float = 1.0, torch_threads: int = 1
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        torch.set_num_threads(torch_threads)
        self.config = config
        self.temperature = float(temperature)
        self.device = pick_device()
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=DTYPES[config.dtype],
            local_files_only=True,
            use_safetensors=True,
            **fused_gelu_kwargs(AutoConfig.from_pretrained(model_path, local_files_only=True)),
        )  # the same GELU kernel as the generator and the learner
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.packed = bool(config.pack_sequences)
        if self.packed:
            vocab = self.model.config.get_text_config().vocab_size
            check_packing_exact(self.model, vocab, "reference.pack_sequences")
        # Right padding sits after every real token, so under causal attention its id never matters.
        self.pad_id = pad_id_of(self.model.config)
        self._sequences = 0
        self._tokens = 0
        self._batches = 0
        self._busy_s = 0.0

    def ping(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        return {
            "sequences": float(self._sequences),
            "tokens": float(self._tokens),
            "batches": float(self._batches),
            "busy_s": self._busy_s,
        }

    def logprobs(self, prompts: list[np.ndarray], responses: list[np.ndarray]) -> list[np.ndarray]:
        """float32 log-probability of every response token, one array of length len(response) per row."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        start = time.perf_counter()
        out: list[np.ndarray] = []
        bs = self.config.batch_size
        for i in range(0, len(prompts), bs):
            out.extend(self._batch(prompts[i : i + bs], responses[i : i + bs]))
        self._busy_s += time.perf_counter() - start
        return out

    def _scaled_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """logprobs of `tokens` under logits / temperature, upcast 1024 positions at a time, so a
        low-precision model never holds a float32 copy of the whole block."""
        flat, tok = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        parts = [
            logprobs_from_logits(c.float() / self.temperature, t)
            for c, t in zip(flat.split(1024), tok.split(1024), strict=True)
        ]
        return torch.cat(parts).reshape(tokens.shape)

    @torch.no_grad()
    def _batch(self, prompts: list[np.ndarray], responses: list[np.ndarray]) -> list[np.ndarray]:
        ids, attn, p_lens, mask = pack_sequences(prompts, responses, self.pad_id)
        R = max(max(len(r) for r in responses), 1)
        if self.packed:  # one padding-free row: logits only at real response positions
            rows = pack_rows(ids, attn, p_lens, mask.sum(1).long(), R).to(self.device)
            logits, _ = packed_response_logits(self.model, rows)
            lp = rows.unpack(self._scaled_logprobs(logits, rows.targets))
        else:
            tokens = response_tokens(ids, p_lens, R).to(self.device)
            ids, attn = ids.to(self.device), attn.to(self.device)
            logits, _ = response_logits(self.model, ids, attn, p_lens, R)  # the model's own output path
            lp = self._scaled_logprobs(logits, tokens)
        lp = lp.cpu().numpy().astype(np.float32)
        self._sequences += len(responses)
        self._tokens += sum(len(r) for r in responses)
        self._batches += 1
        return [lp[j, : len(r)].copy() for j, r in enumerate(responses)]
