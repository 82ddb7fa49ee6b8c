"""What the scoring role's transformers models share: the weights dtypes a config names, and the
longest input a model accepts."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def max_positions(model_config, tokenizer) -> int | None:
    """Longest input the model accepts: its position table, or the tokenizer's limit when that is smaller
    (None: neither says)."""
    limits = [
        getattr(model_config, name, None) for name in ("max_position_embeddings", "n_positions", "n_ctx")
    ]
    limits.append(getattr(tokenizer, "model_max_length", None))
    limits = [int(x) for x in limits if isinstance(x, int) and 0 < x < 1_000_000]
    return min(limits) if limits else None
