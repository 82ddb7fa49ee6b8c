"""Weight bundles: a checksum both ends of a weight sync agree on, and key/shape validation.

The learner checksums the bundle it sends (cast to the engine dtype); a worker checksums what it
holds after loading. Equal strings prove the worker generates with exactly the weights of that version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping

import torch
import xxhash

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config dtype name ('float32', 'bfloat16', 'float16')."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def state_checksum(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """XXH3-128 over sorted keys, shapes, dtypes and bytes; floating tensors are cast to `dtype` first.

    Integer tensors (buffers such as position ids) are never cast. Device and memory layout do not matter.
    The check is against stale or partial loads, not an adversary, so the hash is a fast
    non-cryptographic one: about 30 GB/s on one CPU thread here against sha256's 1.9, which made the
    checksum 0.6 s of each side of a 0.5B push.
    """
    h = xxhash.xxh3_128()
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        h.update(f"{len(name)}:{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def check_state_keys(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
    optional: Collection[str] = (),
    what: str = "model",
) -> None:
    """Raise KeyError/ValueError naming every missing or unknown key and every shape mismatch.

    `expected` maps required names to shapes; names in `optional` may be present (and are then
    shape-checked when they also appear in `expected`) or absent.
    """
    missing = sorted(k for k in expected if k not in state and k not in optional)
    unknown = sorted(k for k in state if k not in expected and k not in optional)
    if missing or unknown:
        raise KeyError(
            f"weight bundle does not match the {what}: "
            f"{len(missing)} missing key(s) {listed(missing)}, {len(unknown)} unknown key(s) {listed(unknown)}"
        )
    bad = [
        f"{k}: bundle {tuple(state[k].shape)} vs {what} {tuple(shape)}"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != tuple(shape)
    ]
    if bad:
        raise ValueError(f"weight bundle shapes do not match the {what}: {listed(bad)}")


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (e.g. GPT-2's `transformer.wte.weight` and `lm_head.weight`),
    in state-dict order; works on a meta-device skeleton too."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def check_tied_copies(state: Mapping[str, torch.Tensor], groups: list[list[str]]) -> None:
    """A bundle's copies of tied weights must be equal: the model holds one tensor for all of them,
    so differing copies would leave it holding whichever an engine happened to read."""
    for names in groups:
        first = names[0]
        for other in names[1:]:
            if first in state and other in state and not torch.equal(state[first], state[other]):
                raise ValueError(
                    f"tied weights {first!r} and {other!r} differ in the bundle; they must be equal"
                )


def listed(items: list[str], n: int = 8) -> str:
    """The first `n` of `items` for an error message, and how many more there are."""
    return str(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


DIGEST_SAMPLES = 4096  # elements per tensor


def digest_sample(t: torch.Tensor, dtype: torch.dtype | None = None) -> bytes:
    """The bytes `sampled_digest` hashes for one tensor: `DIGEST_SAMPLES` evenly spaced elements (all of
    a smaller tensor), a floating one cast to `dtype` first."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n > DIGEST_SAMPLES:
        # integer steps: float linspace rounds past the last index for tensors of ~16M+ elements
        flat = flat[torch.arange(DIGEST_SAMPLES, device=flat.device) * (n - 1) // (DIGEST_SAMPLES - 1)]
    if dtype is not None and flat.is_floating_point():
        flat = flat.to(dtype)
    return flat.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def combine_digest(samples: Mapping[str, tuple[tuple[int, ...], bytes]]) -> str:
    """sha256 over names (sorted), shapes and `digest_sample` bytes: what `sampled_digest` returns, from
    pieces taken one tensor at a time (a bundle that arrives bucket by bucket)."""
    h = hashlib.sha256()
    for name in sorted(samples):
        shape, data = samples[name]
        h.update(f"{len(name)}:{name}|{tuple(shape)}|".encode())
        h.update(data)
    return h.hexdigest()


def sampled_digest(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> str:
    """sha256 over names, shapes and `DIGEST_SAMPLES` evenly spaced elements of every tensor (all of a
    smaller one), floating ones cast to `dtype` first: cheap at any model size (a few MB read) and,
    unlike probe logprobs, it changes after one optimizer step. Adam moves every weight with a
    gradient history by about the learning rate, which changes the bf16 rounding of about lr / ulp of
    the elements: at lr 1e-6 and weights ~0.02 (ulp 2^-13) about 1 in 120, so among 4096 samples of
    each of a model's tensors some always change. Names are sorted."""
    return combine_digest({name: (tuple(t.shape), digest_sample(t, dtype)) for name, t in tensors})
