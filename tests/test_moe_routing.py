"""kernel.moe_routing on the tiny Qwen3-MoE and Mixtral: the replayed gate values by hand; replaying a
forward's own recorded routing reproduces it bit for bit (float32 and bf16, a padded batch) with the
same router gradient; replaying other experts makes the model route exactly there while the router still
gets a gradient; refusals."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import MOE_FAMILIES, build_causal_lm
from transformers import AutoModelForCausalLM

from kernel.moe_routing import (
    NOT_RECORDED,
    moe_routers,
    record_routing,
    replay_routing,
    replayed_gate_weights,
)

IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13, 14, 15, 0, 0, 0]])
MASK = (IDS != 0).long()


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_dir(request, tmp_path_factory):
    return build_causal_lm(tmp_path_factory.mktemp(request.param), request.param, seed=2)


def _model(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def test_replayed_gate_weights_by_hand():
    # softmax of [0, ln 2, ln 3, 0] is [1, 2, 3, 1] / 7; experts (2, 1) get 3/7 and 2/7, renormalised 0.6, 0.4
    logits = torch.tensor([[0.0, math.log(2), math.log(3), 0.0]], requires_grad=True)
    index = torch.tensor([[2, 1]])
    torch.testing.assert_close(
        replayed_gate_weights(logits, index, True, torch.float32), torch.tensor([[0.6, 0.4]])
    )
    raw = replayed_gate_weights(logits, index, False, torch.float32)
    torch.testing.assert_close(raw, torch.tensor([[3 / 7, 2 / 7]]))
    raw[0, 0].backward()  # d p_2 / d z = p_2 (onehot_2 - p): the logits get a gradient
    p = torch.tensor([1.0, 2.0, 3.0, 1.0]) / 7
    torch.testing.assert_close(logits.grad[0], p[2] * (torch.eye(4)[2] - p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replaying_the_own_routing_is_the_same_forward(moe_dir, dtype):
    model = _model(moe_dir, dtype)
    routers = moe_routers(model)
    assert len(routers) == 2
    with record_routing(model) as taken:
        plain = model(input_ids=IDS, attention_mask=MASK).logits
    layers = [t[0] for t in taken]
    assert all(t.dtype == torch.uint8 and t.shape == (IDS.numel(), 2) for t in layers)
    with replay_routing(model, layers):
        replayed = model(input_ids=IDS, attention_mask=MASK).logits
    assert torch.equal(replayed, plain)


def _router_grads(model, indices=None) -> list[torch.Tensor]:
    model.zero_grad()
    ctx = replay_routing(model, indices) if indices is not None else torch.enable_grad()
    with ctx:
        model(input_ids=IDS, attention_mask=MASK).logits.logsumexp(-1).mean().backward()
    return [r.weight.grad.clone() for r in moe_routers(model)]


def test_replayed_experts_are_used_and_the_router_still_learns(moe_dir):
    model = _model(moe_dir)
    with record_routing(model) as taken:
        plain = model(input_ids=IDS, attention_mask=MASK).logits.detach()
    own = [t[0] for t in taken]
    # Same routing, same gradient: the gate values keep their path to the router's weight.
    for a, b in zip(_router_grads(model, own), _router_grads(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    experts = moe_routers(model)[0].weight.shape[0]
    other = [((t.long() + 1) % experts).to(torch.uint8) for t in own]  # every choice moved to the next expert
    with replay_routing(model, other), record_routing(model) as seen:
        moved = model(input_ids=IDS, attention_mask=MASK).logits.detach()
    assert all(torch.equal(s[0], o) for s, o in zip(seen, other, strict=True))  # routed exactly there
    assert (moved - plain).abs().max() > 1e-3
    assert all(g.abs().sum() > 0 for g in _router_grads(model, other))


def test_refusals(moe_dir, tmp_path):
    model = _model(moe_dir)
    one_layer = [torch.zeros(IDS.numel(), 2, dtype=torch.uint8)]
    with (
        pytest.raises(ValueError, match="1 layers of routing for a model with 2 MoE layers"),
        replay_routing(model, one_layer),
    ):
        pass
    short = [torch.zeros(3, 2, dtype=torch.uint8)] * 2
    with (
        pytest.raises(ValueError, match=r"MoE layer 0: replayed routing \(3, 2\), tokens \(16, 2\)"),
        replay_routing(model, short),
    ):
        model(input_ids=IDS)
    dense = _model(build_causal_lm(tmp_path / "llama", "llama"))
    with pytest.raises(ValueError, match="has no MoE layers"), record_routing(dense):
        pass


def test_unrecorded_tokens_keep_their_own_routing(moe_dir):
    model = _model(moe_dir)
    with record_routing(model) as taken:
        plain = model(input_ids=IDS, attention_mask=MASK).logits.detach()
    own = [t[0] for t in taken]
    experts = moe_routers(model)[0].weight.shape[0]
    other = [((t.long() + 1) % experts).to(torch.uint8) for t in own]
    half = IDS.shape[1] // 2  # row 0's first half is NOT_RECORDED, the rest replays other experts
    for o in other:
        o[:half] = NOT_RECORDED
    with replay_routing(model, other), record_routing(model) as seen:
        moved = model(input_ids=IDS, attention_mask=MASK).logits.detach()
    for s, o, m in zip(seen, other, own, strict=True):
        assert torch.equal(s[0][:half], m[:half]) and torch.equal(s[0][half:], o[half:])
    # causal: row 0's first half sees only its own, unreplayed routing
    torch.testing.assert_close(moved[0, :half], plain[0, :half], atol=0, rtol=0)
    assert (moved[0, half:] - plain[0, half:]).abs().max() > 1e-3


@pytest.mark.parametrize("lora", ["experts", "all-linear"])
def test_routing_is_found_through_peft_wrappers(moe_dir, lora):
    """LoRA on the expert stacks (or everywhere, the router too) wraps the modules; the routers are still
    found, recorded and replayed, and replaying the own routing is the same forward."""
    from peft import LoraConfig, get_peft_model

    targets = (
        {"target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}
        if lora == "experts"
        else {"target_modules": "all-linear"}
    )
    model = get_peft_model(_model(moe_dir), LoraConfig(r=2, init_lora_weights=False, **targets)).eval()
    assert len(moe_routers(model)) == 2
    with record_routing(model) as taken:
        plain = model(input_ids=IDS, attention_mask=MASK).logits
    with replay_routing(model, [t[0] for t in taken]):
        replayed = model(input_ids=IDS, attention_mask=MASK).logits
    assert torch.equal(replayed, plain)
    other = [((t[0].long() + 1) % 4).to(torch.uint8) for t in taken]
    with replay_routing(model, other), record_routing(model) as seen:
        moved = model(input_ids=IDS, attention_mask=MASK).logits
    assert all(torch.equal(s[0], o) for s, o in zip(seen, other, strict=True))
    assert (moved - plain).abs().max() > 1e-3
