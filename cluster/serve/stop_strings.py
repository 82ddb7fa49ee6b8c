"""Stop strings of Tinker's `SamplingParams.stop` (a renderer's `get_stop_sequences()`, e.g. the role-colon
format's "\\n\\nUser:") on an engine whose contract stops on token ids only.

The rule (vLLM's, which Tinker's sampler follows): a response ends with the first token after which the
decoded response contains one of the stop strings. That token and everything before it are kept with
their logprobs, so the tokens still carry the stop string (a renderer's `parse_response` splits on it);
every later token is dropped and the finish reason is 'stop'. Cutting a drawn sequence changes no token's
distribution: each token was drawn given only the tokens before it, so the kept prefix is exactly what a
sampler that stopped there would have drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def stop_at_strings(ids: np.ndarray, stops: Sequence[str], decode: Callable[[list[int]], str]) -> int | None:
    """The length of `ids` up to and including the token that completes the first stop string in the
    decoded response, or None when no stop string occurs. `decode` turns token ids into text (the base
    model's tokenizer, special tokens kept)."""
    if not stops:
        return None
    tokens = [int(t) for t in ids]
    if not any(s in decode(tokens) for s in stops):
        return None
    for k in range(1, len(tokens) + 1):  # the shortest prefix whose text holds a stop string
        if any(s in decode(tokens[:k]) for s in stops):
            return k
    raise AssertionError("unreachable: the whole response holds a stop string")
