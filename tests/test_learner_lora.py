"""LoRA on the policy (learner.lora), in process and fast: the merge formula, the merged export against
PEFT's own merge, the adapter in PEFT's format, and clear errors for bad `learner.lora` fields. The
real DeepSpeed ranks (ZeRO-2/3, a PPO step, engines, resume) are in test_learner_lora_ranks."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from learner.config import LearnerConfig, LoRAConfig
from learner.lora import (
    adapter_state,
    check_targets,
    has_lora,
    lora_layers,
    merge_weight,
    merged_cpu_state_dict,
    save_adapter,
)
from learner.model import PolicyWithValueHead

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear")
BIG = 1 << 30


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def _trained(path, cfg: LoRAConfig = LORA) -> PolicyWithValueHead:
    """The learner's model with LoRA, its adapters set to random values (PEFT starts B at zero)."""
    model = PolicyWithValueHead.from_pretrained(path, lora=cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.policy.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def test_merge_weight_is_base_plus_scaled_product():
    """W + B A alpha/r by hand, for [out, in] weights and GPT-2's transposed [in, out] Conv1D."""
    gen = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(s, generator=gen) for s in ((6, 5), (3, 5), (6, 3)))
    want = w.clone()
    for i in range(6):
        for j in range(5):
            want[i, j] += sum(float(b[i, k]) * float(a[k, j]) for k in range(3)) * 8 / 3
    torch.testing.assert_close(merge_weight(w, a, b, 8 / 3), want)
    torch.testing.assert_close(merge_weight(w.T.contiguous(), a, b, 8 / 3, fan_in_fan_out=True), want.T)


def test_only_adapters_train_and_the_merged_export_is_peft_merge(tiny_policy_dir, tmp_path):
    """Only lora_A/B require grad; the merged state has the base model's names and equals both the
    formula per layer and PEFT's `merge_and_unload`; the PEFT-format adapter loads back in PEFT."""
    from peft import PeftModel, get_peft_model
    from peft.tuners.lora import LoraLayer

    from learner.lora import peft_config

    model = _trained(tiny_policy_dir)
    trainable = [n for n, p in model.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert model.value_head.weight.requires_grad and has_lora(model.policy)
    assert {layer.scale for layer in lora_layers(model.policy)} == {2.0}

    merged = merged_cpu_state_dict(model.policy, bucket_bytes=4096, keep=True)  # many small buckets
    base = _hf(tiny_policy_dir).state_dict()
    assert list(merged) == list(base)
    layer = model.policy.transformer.h[0].attn.c_attn
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    by_hand = base["transformer.h.0.attn.c_attn.weight"] + (b @ a).T.detach() * (8.0 / 4)
    torch.testing.assert_close(merged["transformer.h.0.attn.c_attn.weight"], by_hand)
    assert torch.equal(merged["transformer.wte.weight"], base["transformer.wte.weight"])  # not adapted
    assert merged["lm_head.weight"] is merged["transformer.wte.weight"]  # still tied

    reference = get_peft_model(_hf(tiny_policy_dir), peft_config(LORA))
    reference.load_state_dict(
        {f"base_model.model.{n}": p for n, p in model.policy.named_parameters() if p.requires_grad},
        strict=False,
    )
    peft_merged = reference.merge_and_unload().state_dict()
    for name in base:
        torch.testing.assert_close(merged[name], peft_merged[name], rtol=0, atol=1e-6)

    save_adapter(tmp_path, LORA, adapter_state(model.policy, BIG, keep=True), str(tiny_policy_dir))
    assert (tmp_path / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(_hf(tiny_policy_dir), str(tmp_path)).eval()
    assert any(isinstance(m, LoraLayer) for m in loaded.modules())
    plain = _hf(tiny_policy_dir)
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 9, 11, 7, 20, 4]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5, rtol=0
        )


def test_rank_zero_is_full_fine_tuning(tiny_policy_dir):
    model = PolicyWithValueHead.from_pretrained(tiny_policy_dir, lora=LoRAConfig())
    assert not has_lora(model.policy) and all(p.requires_grad for p in model.policy.parameters())


def test_the_adapters_start_from_the_runs_seed_not_the_processs_generator(tiny_policy_dir):
    def lora_a(seed: int) -> dict[str, torch.Tensor]:
        model = PolicyWithValueHead.from_pretrained(tiny_policy_dir, lora=LORA, seed=seed)
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    first = lora_a(0)
    torch.rand(1000)  # whatever else the process drew in between
    again, other = lora_a(0), lora_a(1)
    assert first and all(torch.equal(first[n], again[n]) for n in first)
    assert not all(torch.equal(first[n], other[n]) for n in first)


def test_an_export_without_lora_does_not_need_peft(tiny_policy_dir):
    """The learner's export of a plain policy runs where PEFT is not installed (a new process where
    importing it fails, as in an environment without it)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['peft'] = None; "  # `import peft` raises, as for a missing package
        "from learner.model import PolicyWithValueHead; from learner.lora import merged_cpu_state_dict; "
        f"m = PolicyWithValueHead.from_pretrained({str(tiny_policy_dir)!r}); "
        "state = merged_cpu_state_dict(m.policy, 1 << 20, keep=True); print(len(state))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) > 0, done.stderr[-2000:]


def test_bad_lora_fields_are_errors_naming_the_field(tiny_policy_dir):
    model = _hf(tiny_policy_dir)
    with pytest.raises(
        ValueError, match=r"learner\.lora\.target_modules: \['q_proj'\] match no linear.*c_attn"
    ):
        check_targets(model, LoRAConfig(rank=4, target_modules=["c_attn", "q_proj"]))
    with pytest.raises(ValueError, match=r"learner\.lora\.target_modules: \['lm_head'\] share their weight"):
        check_targets(model, LoRAConfig(rank=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match=r"learner\.lora\.modules_to_save: \['nope'\] match no module"):
        check_targets(model, LoRAConfig(rank=4, modules_to_save=["nope"]))
    with pytest.raises(ValueError, match="learner.lora.target_modules"):  # through the learner's loader
        PolicyWithValueHead.from_pretrained(tiny_policy_dir, lora=LoRAConfig(rank=2, target_modules=["wq"]))
    for bad, field in (
        ({"rank": -1}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": "all"}, "target_modules"),
        ({"lora_rank": 8}, "lora_rank"),
    ):
        with pytest.raises(ValidationError, match=field):
            LearnerConfig(lora=bad)


def test_cluster_export_merges_a_lora_checkpoints_adapters(tiny_policy_dir):
    """`cluster.export` reads a LoRA run's checkpoint (adapters only, under the learner's names) and
    writes the merged model; weights that do not fit are refused, naming them."""
    from cluster.export import ExportError, policy_from_weights

    model = _trained(tiny_policy_dir)
    state = {n: p.detach().clone() for n, p in model.policy.named_parameters() if p.requires_grad}
    exported = policy_from_weights(str(tiny_policy_dir), LORA, state).state_dict()
    merged = merged_cpu_state_dict(model.policy, BIG, keep=True)
    assert exported.keys() == merged.keys()
    for name in merged:
        assert torch.equal(exported[name], merged[name]), name
    with pytest.raises(ExportError, match="only in the checkpoint"):
        policy_from_weights(str(tiny_policy_dir), LoRAConfig(), state)  # the run's lora section is needed


def test_adapters_off_is_the_base_model_and_turns_back_on(tiny_policy_dir):
    """learner.reference_from_base's forward: inside `adapters_off` the LoRA model (adapters moved, a
    `modules_to_save` copy retrained) computes the base model's logits; after it, its own again, with
    the same parameters trainable as before."""
    from learner.lora import adapters_off

    model = _trained(tiny_policy_dir, LoRAConfig(rank=4, alpha=8.0, modules_to_save=["ln_f"])).eval()
    trainable = {n for n, p in model.policy.named_parameters() if p.requires_grad}
    assert any(".modules_to_save." in n for n in trainable)
    ids = torch.tensor([[5, 9, 11, 7, 20, 4]])
    with torch.no_grad():
        adapted = model.policy(input_ids=ids).logits
        with adapters_off(model.policy):
            off = model.policy(input_ids=ids).logits
        again = model.policy(input_ids=ids).logits
        base = _hf(tiny_policy_dir)(input_ids=ids).logits
    torch.testing.assert_close(off, base, atol=1e-5, rtol=0)
    assert (adapted - base).abs().max() > 1e-2  # the adapters do change the policy
    assert torch.equal(again, adapted)
    assert {n for n, p in model.policy.named_parameters() if p.requires_grad} == trainable
    with pytest.raises(ValueError, match="no LoRA adapters"), adapters_off(_hf(tiny_policy_dir)):
        pass
