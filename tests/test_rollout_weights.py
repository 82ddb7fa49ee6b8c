"""state_checksum is what the driver and the workers compare after a weight sync."""

from __future__ import annotations

import pytest
import torch

from rollout_workers.weights import check_state_keys, state_checksum, torch_dtype


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 3, generator=g),
        "b.bias": torch.randn(3, generator=g),
        "pos": torch.arange(5),
    }


def test_checksum_ignores_insertion_order_layout_and_autograd():
    s = _state()
    reordered = {k: s[k] for k in reversed(list(s))}
    non_contiguous = dict(s, **{"a.weight": s["a.weight"].T.contiguous().T})
    assert not non_contiguous["a.weight"].is_contiguous()
    with_grad = dict(s, **{"b.bias": s["b.bias"].clone().requires_grad_(True)})
    ref = state_checksum(s)
    assert state_checksum(reordered) == ref
    assert state_checksum(non_contiguous) == ref
    assert state_checksum(with_grad) == ref


def test_checksum_sees_values_names_shapes_and_dtypes():
    s = _state()
    ref = state_checksum(s)
    one_value = dict(s, **{"b.bias": s["b.bias"].clone()})
    one_value["b.bias"][1] += 1e-6
    renamed = {("c.bias" if k == "b.bias" else k): v for k, v in s.items()}
    reshaped = dict(s, **{"a.weight": s["a.weight"].reshape(3, 4)})
    as_double = dict(s, **{"b.bias": s["b.bias"].double()})
    others = [one_value, renamed, reshaped, as_double, _state(seed=1)]
    sums = {state_checksum(x) for x in others}
    assert ref not in sums and len(sums) == len(others)


def test_checksum_casts_floats_only_before_hashing():
    s = _state()
    cast = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in s.items()}
    assert state_checksum(s, torch.bfloat16) == state_checksum(cast)
    assert state_checksum(s, torch.bfloat16) != state_checksum(s)
    assert state_checksum(s, torch.float32) == state_checksum(s)  # already float32: a no-op cast
    assert state_checksum(cast, torch.bfloat16) == state_checksum(cast)  # int "pos" stays int64


def test_checksum_rejects_non_tensors():
    with pytest.raises(TypeError, match="'x'"):
        state_checksum({"x": [1.0, 2.0]})


def test_check_state_keys_names_the_bad_keys():
    expected = {"a.weight": (4, 3), "b.bias": (3,), "pos": (5,)}
    s = _state()
    check_state_keys(s, expected)
    with pytest.raises(KeyError, match=r"1 missing key\(s\) \['b.bias'\].*1 unknown key\(s\) \['z'\]"):
        check_state_keys({"a.weight": s["a.weight"], "pos": s["pos"], "z": s["pos"]}, expected)
    with pytest.raises(ValueError, match=r"a.weight: bundle \(3, 4\) vs model \(4, 3\)"):
        check_state_keys(dict(s, **{"a.weight": s["a.weight"].reshape(3, 4)}), expected)
    check_state_keys({k: v for k, v in s.items() if k != "pos"}, expected, optional={"pos"})


def test_torch_dtype_names():
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="float64"):
        torch_dtype("float64")
