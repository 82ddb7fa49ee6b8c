"""The trained network: a causal LM policy and a scalar value head on its shared backbone."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from kernel.sequences import (
    PackedRows,
    fused_gelu_kwargs,
    gather_response,
    packed_response_logits,
    response_logits,
)
from learner.algorithms import entropy_from_logits, logprobs_from_logits
from learner.chunked_logprobs import chunked_token_scores, linear_logits_reason
from learner.config import LearnerConfig, LoRAConfig
from learner.lora import apply_lora

DEFAULT_CHUNK_TOKENS = 512  # what `logits_chunk_tokens: auto` chunks by where the architecture allows

VALUE_HEAD_FILE = "value_head.safetensors"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Files a rollout worker needs besides the weights to rebuild the tokenizer from a saved policy.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def zero_dropout(config) -> list[str]:
    """Set every float `*dropout` / `*pdrop` field to 0: RL needs a deterministic policy (and RNG).

    Dropout makes the learner's log-probs disagree with the generator's and consumes the global RNG.
    Returns the names of the fields changed.
    """
    changed = []
    for name, value in list(vars(config).items()):
        if (name.endswith("dropout") or name.endswith("pdrop")) and isinstance(value, float) and value != 0.0:
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def resolve_chunk_tokens(config, chunk_tokens: int | str | None) -> int | None:
    """The chunk size the learner scores tokens with for a model of `config`: `None` (full logits),
    `auto` (DEFAULT_CHUNK_TOKENS where the logits are exactly lm_head(hidden), else None) or an int,
    refused (ValueError) where they are not."""
    if chunk_tokens is None:
        return None
    reason = linear_logits_reason(config)
    if chunk_tokens == "auto":
        return None if reason else DEFAULT_CHUNK_TOKENS
    if reason:
        raise ValueError(
            f"learner.logits_chunk_tokens={chunk_tokens} needs logits that are exactly lm_head(hidden), but "
            f"{reason}; set logits_chunk_tokens: auto or null (the model's own full logits path)"
        )
    return int(chunk_tokens)


class TokenScores(NamedTuple):
    """What `PolicyWithValueHead.forward(..., targets=...)` returns, in its `[B, R]` (or packed `[K]`) layout."""

    logprobs: torch.Tensor  # float32 log pi(target) at temperature T
    entropy: torch.Tensor | None  # float32, only when asked for
    values: torch.Tensor


def learner_config(path: str | Path):
    """The HF config of the policy at `path` as the learner trains it: dropout off (also in a composite
    model's text config) and the fused tanh-GELU name (`fused_gelu_kwargs`, as the other roles load it).
    `cluster.export` loads checkpoints through it, so an exported model computes what the learner did."""
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    zero_dropout(config)
    text_cfg = config.get_text_config()
    if text_cfg is not config:
        zero_dropout(text_cfg)
    config.update(fused_gelu_kwargs(config))
    return config


def load_policy(
    path: str | Path,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """The HF causal LM of a local folder (nothing downloaded) in `dtype`, gradient checkpointing on where
    asked: `PolicyWithValueHead.from_pretrained`'s first step (no adapters, no value head yet)."""
    if dtype not in _DTYPES:
        raise ValueError(f"unknown learner dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    config = learner_config(path)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    policy = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=_DTYPES[dtype], local_files_only=True, use_safetensors=True, **extra
    )
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(policy, "activation_checkpointing_enable"):  # transformers >= 5.x name
            policy.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return policy


def learner_policy(path: str | Path, config: LearnerConfig) -> PreTrainedModel:
    """`load_policy` with a learner config's fields (dtype, gradient checkpointing, attention): the part of
    `PolicyWithValueHead.for_learner` that does not depend on the adapter or the seed."""
    return load_policy(path, config.dtype, config.gradient_checkpointing, config.attn_implementation)


class PolicyWithValueHead(nn.Module):
    """Policy logits and values from one forward of the HF model, projected only where response tokens are scored.

    For a row with prompt length p, position p-1+t scores response token t (see kernel.sequences);
    the vocabulary projection runs on those R positions only where the model allows it, which keeps
    the [B, R, V] logits small (`kernel.sequences.response_logits`). With `logits_chunk_tokens` (an int,
    see `resolve_chunk_tokens`) a forward given `targets` never builds those logits: the token logprobs
    come from the final hidden states a chunk at a time (`learner.chunked_logprobs`).
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        value_head_std: float = 0.0,
        seed: int = 0,
        logits_chunk_tokens: int | str | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.logits_chunk_tokens = resolve_chunk_tokens(policy.config, logits_chunk_tokens)
        hidden = policy.config.get_text_config().hidden_size
        self.value_head = nn.Linear(hidden, 1, dtype=next(policy.parameters()).dtype)
        # A private generator: every rank must start from the same head whatever its own seed.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            if value_head_std > 0:
                w = torch.randn(self.value_head.weight.shape, generator=gen) * value_head_std
                self.value_head.weight.copy_(w)
            else:
                self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: str = "float32",
        value_head_std: float = 0.0,
        gradient_checkpointing: bool = False,
        seed: int = 0,
        attn_implementation: str | None = None,
        lora: LoRAConfig | None = None,
        logits_chunk_tokens: int | str | None = None,
    ) -> PolicyWithValueHead:
        """Load the HF policy from a local folder with dropout off, plus a fresh (or saved) value head;
        with `lora` of rank > 0 the policy gets PEFT adapters and its own weights freeze (learner.lora).
        Two steps, `load_policy` then `around` (a Tinker pool actor runs the first ahead of its request)."""
        policy = load_policy(path, dtype, gradient_checkpointing, attn_implementation)
        return cls.around(policy, path, value_head_std, seed, lora, logits_chunk_tokens)

    @classmethod
    def around(
        cls,
        policy: PreTrainedModel,
        path: str | Path,
        value_head_std: float = 0.0,
        seed: int = 0,
        lora: LoRAConfig | None = None,
        logits_chunk_tokens: int | str | None = None,
    ) -> PolicyWithValueHead:
        """The model on a `load_policy` result from `path`: its LoRA adapters (rank > 0, drawn from `seed`),
        a fresh value head (or the one saved in `path`). `from_pretrained`'s second step."""
        if lora is not None and lora.rank > 0:
            # PEFT draws each lora_A from torch's global generator: seed it, so the adapters' start
            # follows the run's seed and not whatever this process drew before.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                policy = apply_lora(policy, lora)
        model = cls(policy, value_head_std=value_head_std, seed=seed, logits_chunk_tokens=logits_chunk_tokens)
        model.train()  # from_pretrained leaves eval mode, in which HF skips gradient checkpointing
        saved_head = Path(path) / VALUE_HEAD_FILE
        if saved_head.exists():
            model.value_head.load_state_dict(load_file(str(saved_head)))
        return model

    @classmethod
    def for_learner(
        cls, path: str | Path, config: LearnerConfig, seed: int = 0, policy: PreTrainedModel | None = None
    ) -> PolicyWithValueHead:
        """`from_pretrained` with every model field of a learner's `config` (dtype, value-head init,
        gradient checkpointing, attention, LoRA, logits chunking): how a learner rank, and a Tinker
        tenant (`cluster.serve.tenant`), load the model their DeepSpeed engine wraps. `policy`: the HF
        policy `learner_policy(path, config)` loaded already (a tenant's warm pool actor), else loaded here."""
        if policy is None:
            policy = learner_policy(path, config)
        return cls.around(policy, path, config.value_head_std, seed, config.lora, config.logits_chunk_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_lens: torch.Tensor,
        response_len: int,
        temperature: float = 1.0,
        packed: PackedRows | None = None,
        targets: torch.Tensor | None = None,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | TokenScores:
        """`(logits [B, R, V] / temperature, values [B, R])` at the positions scoring response tokens;
        with `packed` (one padding-free row, the other tensors unused) `(logits [K, V], values [K])` at
        its `keep` positions. Given the scored tokens `targets` (`[B, R]`, or `[K]` packed) it returns
        their `TokenScores` instead (entropies with `entropy`), chunked where `logits_chunk_tokens` is set.

        One forward of the HF causal LM: its own output path makes the logits (whatever scaling or
        softcap the architecture applies), and its last hidden state (after the final norm, the
        lm_head's input) feeds the value head. `output_hidden_states=-1` asks only for that last one
        where transformers can select (5.23 does); older versions read it as True and return all layers.
        Chunked, the trunk (`base_model`, whose output is that same last hidden state) runs alone and the
        lm_head's weight is read inside this forward (ZeRO-3 gathers it as an external parameter of this
        module for the forward and the backward).
        """
        if targets is not None and self.logits_chunk_tokens is not None:
            return self._chunked_scores(
                input_ids, attention_mask, prompt_lens, response_len, temperature, packed, targets, entropy
            )
        if packed is not None:
            logits, out = packed_response_logits(self.policy, packed, output_hidden_states=-1)
            hidden = out.hidden_states[-1][0, packed.keep]
        else:
            logits, out = response_logits(
                self.policy, input_ids, attention_mask, prompt_lens, response_len, output_hidden_states=-1
            )
            hidden = gather_response(out.hidden_states[-1], prompt_lens, response_len)
        del out  # the other layers' hidden states, where returned
        values = self.value_head(hidden).squeeze(-1)
        logits = logits / temperature
        if targets is None:
            return logits, values
        ent = entropy_from_logits(logits) if entropy else None
        return TokenScores(logprobs_from_logits(logits, targets), ent, values)

    def _chunked_scores(
        self, input_ids, attention_mask, prompt_lens, response_len, temperature, packed, targets, entropy
    ) -> TokenScores:
        trunk = self.policy.base_model
        if packed is not None:
            out = trunk(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
            hidden = out.last_hidden_state[0, packed.keep]
        else:
            out = trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden = gather_response(out.last_hidden_state, prompt_lens, response_len)
        del out
        values = self.value_head(hidden).squeeze(-1)
        head = self.policy.get_output_embeddings()
        logprobs, ent = chunked_token_scores(
            hidden, head.weight, head.bias, targets, temperature, self.logits_chunk_tokens, entropy
        )
        return TokenScores(logprobs, ent, values)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The HF model's own parameter names (what a rollout worker's `load_state_dict` expects)."""
        return self.policy.state_dict()

    def save_pretrained(
        self,
        path: str | Path,
        tokenizer_from: str | Path | None = None,
        policy_state: dict[str, torch.Tensor] | None = None,
        head_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Write the HF policy (safetensors) and `value_head.safetensors`; copy the tokenizer files along.

        `policy_state` / `head_state`: full CPU state dicts to write instead of the modules' own (what a
        ZeRO-3 learner gathered bucket by bucket; its modules hold only partitions).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(path, state_dict=policy_state)
        head = head_state if head_state is not None else self.value_head.state_dict()
        head = {k: v.detach().to("cpu").contiguous() for k, v in head.items()}
        save_file(head, str(path / VALUE_HEAD_FILE))
        if tokenizer_from is not None:
            for name in _TOKENIZER_FILES:
                src = Path(tokenizer_from) / name
                if src.exists():
                    shutil.copyfile(src, path / name)
