"""The learner's model, packing and cross-rank whitening, without DeepSpeed engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.config import LearnerConfig
from learner.deepspeed_setup import CPU_ZERO, CPU_ZERO3, ds_config, remove_shm_buffers, shm_buffer_path
from learner.model import VALUE_HEAD_FILE, PolicyWithValueHead, zero_dropout
from learner.ppo_step import pack_trajectories
from learner.trajectory import Trajectory


def _rows():
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    responses = [[14, 15], [16, 17, 18, 19], [20]]
    return prompts, responses


def test_value_and_logits_sit_at_the_positions_scoring_each_response_token(tiny_policy_dir):
    model = PolicyWithValueHead.from_pretrained(tiny_policy_dir, value_head_std=0.5, seed=3)
    model.eval()
    prompts, responses = _rows()
    temperature = 0.7
    batch = pack_trajectories(
        [
            Trajectory(
                np.array(p), np.array(r), np.zeros(len(r), np.float32), np.zeros(len(r), np.float32), 0.0
            )
            for p, r in zip(prompts, responses, strict=True)
        ],
        pad_id=0,
    )
    R = batch.mask.shape[1]
    with torch.no_grad():
        logits, values = model(batch.input_ids, batch.attention_mask, batch.prompt_lens, R, temperature)
    assert logits.shape == (3, R, model.policy.config.vocab_size) and values.shape == (3, R)

    hf = AutoModelForCausalLM.from_pretrained(tiny_policy_dir).eval()
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
        positions = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        expected_logits = out.logits[0, positions] / temperature
        expected_values = model.value_head(out.hidden_states[-1][0, positions]).squeeze(-1)
        torch.testing.assert_close(logits[row, : len(r)], expected_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[row, : len(r)], expected_values.detach(), atol=1e-5, rtol=1e-5)
    # The head is random (std 0.5) so the value check above could not pass with a misaligned index.
    assert values[:, 0].abs().min() > 0


def test_dropout_is_switched_off_and_save_pretrained_round_trips(tiny_policy_dir, tmp_path):
    from transformers import GPT2Config

    cfg = GPT2Config(resid_pdrop=0.1, attn_pdrop=0.2, embd_pdrop=0.3, summary_first_dropout=0.4)
    assert sorted(zero_dropout(cfg)) == ["attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout"]
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.0

    model = PolicyWithValueHead.from_pretrained(tiny_policy_dir, value_head_std=0.1)
    assert set(model.policy_state_dict()) == set(
        AutoModelForCausalLM.from_pretrained(tiny_policy_dir).state_dict()
    )
    model.save_pretrained(tmp_path / "saved", tokenizer_from=tiny_policy_dir)
    assert (tmp_path / "saved" / VALUE_HEAD_FILE).exists() and (
        tmp_path / "saved" / "tokenizer.json"
    ).exists()
    again = PolicyWithValueHead.from_pretrained(tmp_path / "saved")
    for name, t in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], t, atol=0, rtol=0)


def test_pack_trajectories_rejects_mismatched_logprobs_and_packs_an_empty_shard():
    bad = Trajectory(np.array([5]), np.array([6, 7]), np.zeros(1, np.float32), np.zeros(2, np.float32), 1.0)
    with pytest.raises(ValueError, match="trajectory 0: 2 response tokens but 1 behaviour"):
        pack_trajectories([bad], pad_id=0)
    empty = pack_trajectories([], pad_id=0)
    assert len(empty) == 0 and empty.mask.sum() == 0


def test_deepspeed_config():  # the warm-up: test_learner_lr_schedule
    cfg = ds_config(
        LearnerConfig(
            zero_stage=3,
            dtype="bfloat16",
            micro_batch_size=4,
            max_grad_norm=0.5,
            deepspeed_overrides={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
        )
    )
    # gloo (no GPU here): ZeRO's buckets sized for a CPU rank, the override on top
    assert cfg["zero_optimization"] == {
        "stage": 3,
        **CPU_ZERO,
        **CPU_ZERO3,
        "stage3_param_persistence_threshold": 0,
    }
    assert ds_config(LearnerConfig(zero_stage=2))["zero_optimization"] == {"stage": 2, **CPU_ZERO}
    gpu = LearnerConfig(zero_stage=3, backend="nccl", num_gpus_per_rank=1)
    assert ds_config(gpu)["zero_optimization"] == {"stage": 3}  # DeepSpeed's own GPU sizes
    assert cfg["bf16"]["enabled"] and cfg["gradient_clipping"] == 0.5
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 1
    assert "bf16" not in ds_config(LearnerConfig())


def test_fused_adam_is_torchs_fused_kernel_and_steps_as_the_default_does():
    """learner.fused_adam: torch's fused AdamW (no partition-sized temporaries), the same update as the
    default implementation to float32 rounding; refused with an offloaded optimizer (DeepSpeed's Adam)."""
    from learner.deepspeed_setup import build_optimizer

    torch.manual_seed(0)
    w0, grads = torch.randn(1000), [torch.randn(1000) for _ in range(3)]
    cfg = dict(lr=1e-2, weight_decay=0.1, adam_betas=(0.9, 0.99), adam_eps=1e-8)
    weights = []
    for fused in (False, True):
        p = torch.nn.Parameter(w0.clone())
        opt = build_optimizer(torch.nn.ParameterList([p]), LearnerConfig(fused_adam=fused, **cfg))
        assert opt.defaults["fused"] is (True if fused else None)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        weights.append(p.detach().clone())
    assert not torch.equal(weights[0], w0)
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="learner.fused_adam and learner.offload_optimizer"):
        LearnerConfig(fused_adam=True, offload_optimizer=True)


def test_gradient_checkpointing_recomputes_blocks_and_keeps_the_gradients(tiny_policy_dir):
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    attn = (ids != 0).long()
    grads, calls = [], []
    for gc in (False, True):
        model = PolicyWithValueHead.from_pretrained(
            tiny_policy_dir, value_head_std=0.1, gradient_checkpointing=gc
        )
        n = [0]
        model.policy.transformer.h[0].mlp.register_forward_pre_hook(
            lambda *a, n=n: n.__setitem__(0, n[0] + 1)
        )
        logits, values = model(ids, attn, torch.tensor([2, 1]), 2)
        (logits.logsumexp(-1).sum() + values.sum()).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        calls.append(n[0])
    assert calls == [1, 2]  # the checkpointed block ran again in backward
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-5)


def test_remove_shm_buffers_deletes_only_this_ranks_file():
    mine = Path(shm_buffer_path("10.0.0.9", 12345, 1))
    other = Path(shm_buffer_path("10.0.0.9", 12345, 0))
    if not mine.parent.is_dir():
        pytest.skip("no /dev/shm on this system")
    try:
        mine.write_bytes(b"x")
        other.write_bytes(b"x")
        assert remove_shm_buffers("10.0.0.9", 12345, 1) == [str(mine)]
        assert not mine.exists() and other.exists()
    finally:
        mine.unlink(missing_ok=True)
        other.unlink(missing_ok=True)
