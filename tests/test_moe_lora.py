"""LoRA on a mixture of experts (learner.lora): adapters on the attention projections (`target_modules`)
and on the fused 3-D expert stacks (`target_parameters`, PEFT's ParamWrapper: one rank-r adapter per
expert), for the tiny Qwen3-MoE and Mixtral. The expert adapters get gradients, the merge formula is
checked by hand and against PEFT's own delta, and the merged export is a plain transformers model
whose logits equal the adapted model's (what cluster.export writes)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MOE_FAMILIES, build_causal_lm
from transformers import AutoModelForCausalLM

from learner.config import LoRAConfig
from learner.lora import (
    ADAPTER,
    adapter_bundle,
    apply_lora,
    check_targets,
    lora_layers,
    merge_expert_weight,
    merged_cpu_state_dict,
)
from learner.model import PolicyWithValueHead

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
LORA = LoRAConfig(
    rank=2, alpha=4.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS
)
BIG = 1 << 30
IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13, 14, 15, 16, 17, 18]])


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_dir(request, tmp_path_factory):
    return build_causal_lm(tmp_path_factory.mktemp(request.param), request.param, seed=2)


def _randomized(model) -> None:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_merge_expert_weight_by_hand():
    """2 experts, rank 1, in 2, out 2. PEFT's layout: A [E r, in] (row e is expert e's), B [out, r E]
    (column e is expert e's). W'_e = W_e + s B_e A_e."""
    w = torch.zeros(2, 2, 2)
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # expert 0: [1, 2]; expert 1: [3, 4]
    b = torch.tensor([[1.0, 10.0], [2.0, 20.0]])  # expert 0: [1, 2]^T; expert 1: [10, 20]^T
    want = torch.tensor([[[1.0, 2.0], [2.0, 4.0]], [[30.0, 40.0], [60.0, 80.0]]]) * 0.5
    torch.testing.assert_close(merge_expert_weight(w, a, b, 0.5), want)
    torch.testing.assert_close(merge_expert_weight(w, a, b, 0.5, out_in=False), want.transpose(1, 2))


def test_the_expert_adapters_train(moe_dir):
    model = PolicyWithValueHead.from_pretrained(moe_dir, lora=LORA)
    layers = {layer.name: layer for layer in lora_layers(model.policy)}
    stacks = [n for n, layer in layers.items() if layer.experts]
    assert len(stacks) == 2 * 2  # two stacks in each of two layers
    assert all(layers[n].experts == 4 for n in stacks)
    trainable = {n for n, p in model.policy.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in trainable)  # the stacks are frozen

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model.policy(input_ids=IDS).logits.logsumexp(-1).mean().backward()
        return {n: p.grad for n, p in model.policy.named_parameters() if p.requires_grad}

    g = grads()  # B starts at 0: only B's gradient is non-zero
    for name in stacks:
        assert g[f"{name}.lora_B.{ADAPTER}.weight"].abs().sum() > 0, name
    _randomized(model.policy)
    g = grads()
    for name in stacks:
        for part in ("lora_A", "lora_B"):
            assert g[f"{name}.{part}.{ADAPTER}.weight"].abs().sum() > 0, (name, part)


# PEFT 0.21's 'all-linear' also wraps the expert stacks and the router (ParamWrappers) on its own.
ALL_LINEAR = LoRAConfig(rank=2, alpha=4.0, target_modules="all-linear")


@pytest.mark.parametrize("cfg", [LORA, ALL_LINEAR], ids=["listed", "all-linear"])
def test_the_merged_export_is_a_plain_model_with_the_adapted_logits(moe_dir, cfg):
    from peft.tuners.lora import ParamWrapper

    model = PolicyWithValueHead.from_pretrained(moe_dir, lora=cfg).eval()
    assert sum(layer.experts > 0 for layer in lora_layers(model.policy)) == 4  # 2 stacks x 2 layers
    _randomized(model.policy)
    merged = merged_cpu_state_dict(model.policy, BIG, keep=True)
    plain = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    assert set(merged) == set(plain.state_dict())  # the base model's own names
    # each stack equals PEFT's own delta on it
    modules = dict(model.policy.named_modules())
    for layer in lora_layers(model.policy):
        if layer.experts:
            wrapper = modules[layer.name]
            assert isinstance(wrapper, ParamWrapper)
            name = f"{layer.name.replace('.base_layer', '')}.{wrapper.parameter_name}"
            with torch.no_grad():
                want = wrapper.get_param() + wrapper.get_delta_weight(ADAPTER)
            torch.testing.assert_close(merged[name], want, atol=1e-6, rtol=0)
    plain.load_state_dict(merged, strict=True)
    with torch.no_grad():
        adapted, exported = model.policy(input_ids=IDS).logits, plain(input_ids=IDS).logits
        base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()(input_ids=IDS).logits
    torch.testing.assert_close(exported, adapted, atol=5e-5, rtol=0)  # float32, another order of sums
    assert (adapted - base).abs().max() > 1e-2  # the adapters changed the model
    with pytest.raises(ValueError, match="lora_sync='merged'"):
        adapter_bundle(model.policy, BIG, keep=True)


def test_bad_target_parameters_are_config_errors(moe_dir):
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"target_parameters: \['experts.w1'\].*experts.down_proj"):
        check_targets(hf, LoRAConfig(rank=2, target_parameters=["experts.w1"]))
    with pytest.raises(ValueError, match="learner.lora.dropout=0.1"):
        apply_lora(hf, LoRAConfig(rank=2, dropout=0.1, target_parameters=EXPERTS))


def test_cluster_export_merges_the_expert_adapters(moe_dir):
    """cluster.export's policy_from_weights: a LoRA checkpoint's adapters (every trainable tensor, expert
    stacks' included) merged into a plain model of the base architecture with the adapted logits."""
    from cluster.export import policy_from_weights

    model = PolicyWithValueHead.from_pretrained(moe_dir, lora=LORA).eval()
    _randomized(model.policy)
    state = {n: p.detach().clone() for n, p in model.policy.named_parameters() if p.requires_grad}
    exported = policy_from_weights(str(moe_dir), LORA, state)
    assert type(exported).__name__ in ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=IDS).logits, model.policy(input_ids=IDS).logits, atol=5e-5, rtol=0
        )
