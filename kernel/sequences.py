"""Packing prompt+response pairs into right-padded tensors, token alignment, and the details every
role that packs or scores tokens must share: the pad id (`pad_id_of`) and the tanh-GELU kernel
(`fused_gelu_kwargs`).

A leaf module (imports nothing of the project), shared by the learner, the reference scorer and
the rollout engine. For a row whose prompt has p tokens, the logits/values that score response
token t live at position p-1+t of the packed sequence.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def pack_sequences(
    prompts: Sequence[np.ndarray | Sequence[int]],
    responses: Sequence[np.ndarray | Sequence[int]],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad prompt+response rows.

    Returns `input_ids [B, L]`, `attention_mask [B, L]`, `prompt_lens [B]` and
    `response_mask [B, R]` where R is the longest response (mask 1 on real response tokens).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("cannot pack an empty batch")
    p_lens = [len(p) for p in prompts]
    r_lens = [len(r) for r in responses]
    if min(p_lens) < 1:
        raise ValueError("every prompt needs at least one token (the response is scored from position p-1)")
    L = max(p + r for p, r in zip(p_lens, r_lens, strict=False))
    R = max(max(r_lens), 1)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), L), dtype=torch.long)
    rmask = torch.zeros((len(prompts), R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=False)):
        row = np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64)])
        ids[i, : len(row)] = torch.from_numpy(row)
        attn[i, : len(row)] = 1
        rmask[i, : len(r)] = 1.0
    return ids, attn, torch.tensor(p_lens, dtype=torch.long), rmask


def response_positions(prompt_lens: torch.Tensor, response_len: int, seq_len: int) -> torch.Tensor:
    """Index [B, R] of the positions whose outputs score response tokens: p-1 .. p+R-2 (clamped)."""
    offsets = torch.arange(response_len, device=prompt_lens.device)
    pos = prompt_lens.unsqueeze(1) - 1 + offsets.unsqueeze(0)
    return pos.clamp(max=seq_len - 1)


def gather_response(x: torch.Tensor, prompt_lens: torch.Tensor, response_len: int) -> torch.Tensor:
    """Select, per row, the R positions scoring the response from `x [B, L, ...]` -> `[B, R, ...]`."""
    pos = response_positions(prompt_lens.to(x.device), response_len, x.shape[1])
    if x.dim() == 2:
        return torch.gather(x, 1, pos)
    idx = pos.view(*pos.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return torch.gather(x, 1, idx)


def response_tokens(input_ids: torch.Tensor, prompt_lens: torch.Tensor, response_len: int) -> torch.Tensor:
    """The response token ids [B, R] (position p+t), for gathering their log-probabilities."""
    pos = response_positions(prompt_lens.to(input_ids.device), response_len, input_ids.shape[1]) + 1
    return torch.gather(input_ids, 1, pos.clamp(max=input_ids.shape[1] - 1))


@functools.cache
def keeps_positions_per_row(model_cls: type) -> bool:
    """Whether `model_cls.forward(logits_to_keep=positions [B, K])` projects, per row, only those K positions.

    True when the model's forward takes `logits_to_keep` and its modeling module slices with transformers'
    shared `slice_logits_to_keep` in a version that reads a 2-D integer tensor as per-row positions
    (transformers 5.23 does, 5.19 does not); other models (and older versions, which would index every row with the
    whole [B, K] block) get an integer tail count instead. The check runs the slicer on a 2x2 example.
    """
    if "logits_to_keep" not in inspect.signature(model_cls.forward).parameters:
        return False
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        return False
    if (
        getattr(sys.modules.get(model_cls.__module__), "slice_logits_to_keep", None)
        is not slice_logits_to_keep
    ):
        return False
    try:
        rows = slice_logits_to_keep(torch.arange(4.0).view(2, 2, 1), torch.tensor([[1], [0]]))
    except (IndexError, RuntimeError, TypeError):
        return False
    return rows.flatten().tolist() == [1.0, 2.0]


def response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lens: torch.Tensor,
    response_len: int,
    **forward_kwargs,
):
    """`(logits [B, R, V], output)`: the logits scoring each row's R response tokens, from one call of the
    causal LM's own forward, so its own output path applies (Gemma's final softcap, Cohere's
    `logit_scale`, Granite's `logits_scaling`, ...); `output` is what the forward returned (e.g. its
    `hidden_states` when asked for with `forward_kwargs`). Every role that scores tokens (learner,
    reference, probes) calls this one function, so they agree to rounding.

    The vocabulary projection runs only where needed: at the R scoring positions of each row when the
    model takes per-row positions (`keeps_positions_per_row`), else on the tail from the earliest
    scoring position (integer `logits_to_keep`), else on every position. No temperature is applied.
    """
    prompt_lens = prompt_lens.to(input_ids.device)
    B, L = input_ids.shape
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False, **forward_kwargs}
    cls = type(model)
    if keeps_positions_per_row(cls):
        out = model(**kwargs, logits_to_keep=response_positions(prompt_lens, response_len, L))
        logits = out.logits
        if tuple(logits.shape[:2]) != (B, response_len):
            raise RuntimeError(
                f"{cls.__name__} returned logits of shape {tuple(logits.shape)} for per-row logits_to_keep "
                f"[{B}, {response_len}]: its forward does not slice positions row by row"
            )
        return logits, out
    if "logits_to_keep" in inspect.signature(cls.forward).parameters:
        first = int(prompt_lens.min()) - 1  # the earliest scoring position of any row
        out = model(**kwargs, logits_to_keep=L - first)
        return gather_response(out.logits, prompt_lens - first, response_len), out
    out = model(**kwargs)
    return gather_response(out.logits, prompt_lens, response_len), out


@dataclass(frozen=True)
class PackedRows:
    """Right-padded rows laid end to end in one row with no padding (padding-free packing).

    `position_ids` restart at 0 for each sequence; with no attention mask, transformers' own masking
    reads the restarts as sequence boundaries (a block-diagonal causal mask with SDPA/eager, varlen
    with flash-attention), so no token attends across sequences. `keep` are the packed positions
    whose outputs score response tokens, row by row; output k belongs at `[rows[k], cols[k]]` of the
    padded `[B, R]` layout and scores token `targets[k]`."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    keep: torch.Tensor  # [K]
    rows: torch.Tensor  # [K]
    cols: torch.Tensor  # [K]
    targets: torch.Tensor  # [K]
    shape: tuple[int, int]  # (B, R) of the padded layout

    def to(self, device) -> PackedRows:
        moved = {
            k: getattr(self, k).to(device)
            for k in ("input_ids", "position_ids", "keep", "rows", "cols", "targets")
        }
        return PackedRows(**moved, shape=self.shape)

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-output values `[K]` into the padded `[B, R]` layout (0 where a row has no output)."""
        out = flat.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), flat)


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lens: torch.Tensor,
    counts: torch.Tensor,
    R: int,
) -> PackedRows:
    """Pack right-padded rows; row i keeps `counts[i]` (at most R) outputs from position p_i - 1 on.

    A row of n real tokens scores at most n - p + 1 positions (the last one, the state after its
    final token, is what a truncated response bootstraps its value from)."""
    lengths = attention_mask.sum(1).long()
    prompt_lens = prompt_lens.long()
    counts = torch.minimum(counts.long().clamp(min=1), (lengths - prompt_lens + 1).clamp(min=1)).clamp(max=R)
    offsets = torch.cumsum(lengths, 0) - lengths
    real = attention_mask.bool()
    ids = input_ids[real].unsqueeze(0)
    pos = (torch.arange(input_ids.shape[1]).expand_as(input_ids))[real].unsqueeze(0)
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
    cols = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    keep = offsets[rows] + prompt_lens[rows] - 1 + cols
    last = offsets[rows] + lengths[rows] - 1  # a row's final output scores no token of its own
    targets = ids[0, torch.minimum(keep + 1, last)]
    return PackedRows(ids, pos, keep, rows, cols, targets, (int(input_ids.shape[0]), int(R)))


def packed_response_logits(model: torch.nn.Module, packed: PackedRows, **forward_kwargs):
    """`(logits [K, V], output)` of the packed row's scoring positions from one call of the model's own
    forward (see `response_logits`): projected only at `keep` where the model takes per-row positions."""
    kwargs = {
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "attention_mask": None,
        "use_cache": False,
        **forward_kwargs,
    }
    if keeps_positions_per_row(type(model)):
        out = model(**kwargs, logits_to_keep=packed.keep.unsqueeze(0))
        return out.logits[0], out
    out = model(**kwargs)
    return out.logits[0, packed.keep], out


def check_packing_exact(model: torch.nn.Module, vocab_size: int, field: str) -> float:
    """Score two probe sequences packed and padded; refuse (ValueError naming `field`, the architecture
    and the attention implementation) a model whose packed logits differ, i.e. one whose forward does
    not honour restarting position ids. Returns the largest difference seen."""
    a, b = probe_sequences(vocab_size, count=2, length=6)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    ids, attn, p_lens, mask = pack_sequences([a[:3], b[:2]], [a[3:], b[2:]], 0)
    R = mask.shape[1]
    counts = mask.sum(1).long()
    impl = getattr(model.config, "_attn_implementation", None)
    what = f"{field}: {type(model).__name__} (attention implementation {impl!r})"
    with torch.no_grad():
        padded, _ = response_logits(model, ids.to(device), attn.to(device), p_lens.to(device), R)
        packed = pack_rows(ids, attn, p_lens, counts, R).to(device)
        try:
            flat, _ = packed_response_logits(model, packed)
        except TypeError as err:  # a forward without position_ids
            raise ValueError(f"{what} cannot take packed sequences ({err}); set {field}: false") from err
    diff = float((padded[packed.rows, packed.cols].float() - flat.float()).abs().max())
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # rounding of the two layouts; a leak is O(0.1-1)
    if not diff <= tol:
        raise ValueError(
            f"{what} does not pack sequences exactly (packed and padded logits differ by {diff:.3g} > "
            f"{tol}); set {field}: false"
        )
    return diff


def pad_id_of(special) -> int:
    """The id that fills padded positions, read from a tokenizer or a model config (anything with
    `pad_token_id` and `eos_token_id`): its pad, else its smallest EOS id (a config may list several),
    else 0. Padding only ever sits at masked positions, so the id changes no computed value; the driver
    (for the learner), the rollout engine and the reference all take it through this one rule."""
    pad = getattr(special, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    eos = getattr(special, "eos_token_id", None)
    if isinstance(eos, list | tuple):
        eos = min(eos, default=None)
    return int(eos) if eos is not None else 0


# The tanh-approximated GELU, 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x^3))), has two names in
# transformers' activation table: "gelu_new" (`NewGELUActivation`, about eight elementwise ops in
# Python) and "gelu_pytorch_tanh" (torch's single fused kernel; results differ by rounding, ~1e-7).
# GPT-2-family checkpoints (GPT-2 itself, and the demo policies, built with `GPT2Config`'s default)
# name the first; with the second the demo policy's learner forward/backward runs ~13% and its
# reference forward ~20% faster. The choice is made at load time, not in the demo builders, so that
# demo assets already built (their format version unchanged) and GPT-2 checkpoints from elsewhere get
# it too. Per architecture (`model_type`): the config field its MLP reads through `ACT2FN`.
TANH_GELU_FIELDS = {
    "gpt2": "activation_function",
    "gpt_neo": "activation_function",
    "gptj": "activation_function",
    "codegen": "activation_function",
}


def fused_gelu_kwargs(config) -> dict[str, str]:
    """Config overrides (`from_pretrained` keyword arguments) that load a GPT-2-family checkpoint whose
    config names "gelu_new" with "gelu_pytorch_tanh" instead, the same function as torch's fused kernel;
    `{}` for every other config. The learner, the reference and the HF rollout engine all load through
    it, so their logprobs keep agreeing to rounding. The checkpoint's files are untouched; a policy the
    learner saves carries the fused name."""
    field = TANH_GELU_FIELDS.get(getattr(config, "model_type", None))
    if field is None or getattr(config, field, None) != "gelu_new":
        return {}
    return {field: "gelu_pytorch_tanh"}


# A weight swap is acknowledged by what the engine computes: the generator and the learner both score
# these few fixed sequences with their own forward; equal logprobs (within numerics) mean equal weights.
PROBE_SEED = 20261123


def probe_sequences(vocab_size: int, count: int = 4, length: int = 8) -> list[np.ndarray]:
    """`count` fixed int64 token sequences of `length`..`length+count-1` tokens drawn from the vocabulary:
    the same for every role that knows the vocabulary size."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = np.random.default_rng([PROBE_SEED, int(vocab_size)])
    return [rng.integers(0, vocab_size, size=length + i, dtype=np.int64) for i in range(count)]


def right_padded(
    sequences: Sequence[np.ndarray], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as one batch: `(ids [B, L], attention_mask [B, L])`, each row padded on the right
    (with token 0, masked) to the longest. Under causal attention a position never sees the padding
    after it, so each row's logits at its own positions are the unpadded sequence's."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(np.asarray(seq, dtype=np.int64))
        mask[row, : len(seq)] = 1
    return ids.to(device), mask.to(device)


def sequence_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logprobs [L-1] of tokens 1..L-1 of one sequence from its logits [L, V] (temperature 1)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return logp.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
