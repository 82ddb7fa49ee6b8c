"""Token alignment: outputs at positions p-1 .. p+r-2 score a response that starts at p."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel.sequences import gather_response, pack_sequences, response_positions, response_tokens


def test_pack_and_positions_by_hand():
    prompts = [np.array([5, 6, 7]), np.array([8])]
    responses = [np.array([9, 10]), np.array([11, 12, 13])]
    ids, attn, p_lens, rmask = pack_sequences(prompts, responses, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert p_lens.tolist() == [3, 1]
    assert rmask.tolist() == [[1, 1, 0], [1, 1, 1]]
    # Row 0 (p=3, r=2): positions 2, 3 score tokens 9, 10.  Row 1 (p=1, r=3): positions 0, 1, 2.
    pos = response_positions(p_lens, 3, ids.shape[1])
    assert pos[0, :2].tolist() == [2, 3] and pos[1].tolist() == [0, 1, 2]
    assert response_tokens(ids, p_lens, 3)[0, :2].tolist() == [9, 10]
    assert response_tokens(ids, p_lens, 3)[1].tolist() == [11, 12, 13]


def test_gather_response_picks_the_predicting_position():
    # x[b, l] = 100 * b + l: the value at position l predicts token l + 1.
    x = torch.arange(2 * 5).view(2, 5).float() + torch.tensor([[0.0], [95.0]])
    out = gather_response(x, torch.tensor([3, 1]), 2)
    assert out.tolist() == [[2.0, 3.0], [100.0, 101.0]]
    h = x.unsqueeze(-1).expand(-1, -1, 4)
    assert torch.equal(gather_response(h, torch.tensor([3, 1]), 2), out.unsqueeze(-1).expand(-1, -1, 4))


def test_pack_rejects_empty_prompts_and_mismatches():
    with pytest.raises(ValueError, match="at least one token"):
        pack_sequences([np.array([], dtype=np.int64)], [np.array([1])], 0)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pack_sequences([np.array([1]), np.array([2])], [np.array([1])], 0)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_gelu_new_and_gelu_pytorch_tanh_are_one_function(dtype, atol):
    """The two names of the tanh GELU agree to rounding on random input: float32 within 1e-6 absolute
    plus 1e-6 relative (the worst of these 200k N(0, 4^2) draws is ~2.4e-7), float64 within
    1e-12, so they are the same formula, not merely close."""
    from transformers.activations import ACT2FN

    x = (torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    torch.testing.assert_close(ACT2FN["gelu_pytorch_tanh"](x), ACT2FN["gelu_new"](x), atol=atol, rtol=atol)


def test_fused_gelu_kwargs_only_rename_a_gpt2_family_gelu_new():
    from transformers import GPT2Config, GPTNeoConfig, LlamaConfig

    from kernel.sequences import fused_gelu_kwargs

    fused = {"activation_function": "gelu_pytorch_tanh"}
    assert fused_gelu_kwargs(GPT2Config()) == fused  # transformers' GPT-2 default is "gelu_new"
    assert fused_gelu_kwargs(GPTNeoConfig()) == fused
    assert fused_gelu_kwargs(GPT2Config(activation_function="gelu_pytorch_tanh")) == {}
    assert fused_gelu_kwargs(GPT2Config(activation_function="relu")) == {}
    assert fused_gelu_kwargs(LlamaConfig()) == {}


def test_every_loader_runs_a_gelu_new_checkpoint_with_the_fused_kernel(tiny_policy_dir):
    """The learner, the reference and the HF engine load the tiny GPT-2 (config "gelu_new", the file left
    as it is) with torch's fused tanh GELU, and score tokens as the checkpoint's own config does."""
    import json

    from transformers import AutoModelForCausalLM
    from transformers.activations import GELUTanh, NewGELUActivation

    from learner.model import PolicyWithValueHead
    from reward_service.config import ReferenceConfig
    from reward_service.reference import ReferencePolicy
    from rollout_workers.config import RolloutConfig
    from rollout_workers.hf_engine import HFEngine

    assert json.loads((tiny_policy_dir / "config.json").read_text())["activation_function"] == "gelu_new"
    models = {
        "learner": PolicyWithValueHead.from_pretrained(tiny_policy_dir).policy,
        "reference": ReferencePolicy(str(tiny_policy_dir), ReferenceConfig()).model,
        "hf engine": HFEngine(str(tiny_policy_dir), RolloutConfig()).model,
    }
    as_saved = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, local_files_only=True).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 2]])
    with torch.no_grad():
        expected = as_saved(input_ids=ids).logits
    for role, model in models.items():
        kinds = {type(m) for m in model.modules()}
        assert GELUTanh in kinds and NewGELUActivation not in kinds, role
        assert model.config.activation_function == "gelu_pytorch_tanh", role
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
    assert json.loads((tiny_policy_dir / "config.json").read_text())["activation_function"] == "gelu_new"


@pytest.mark.parametrize(
    ("pad", "eos", "expected"),
    [
        (0, 2, 0),  # a pad set: the pad
        (0, [5, 3], 0),
        (None, 2, 2),  # no pad, one EOS: the EOS
        (None, [7, 3, 5], 3),  # no pad, a config's list of EOS ids: the smallest
        (None, (9,), 9),
        (None, [], 0),  # nothing named: 0 (the positions are masked anyway)
        (None, None, 0),
    ],
)
def test_pad_id_of_worked_cases(pad, eos, expected):
    from types import SimpleNamespace

    from kernel.sequences import pad_id_of

    assert pad_id_of(SimpleNamespace(pad_token_id=pad, eos_token_id=eos)) == expected


def test_pad_id_of_reads_tokenizers_and_configs():
    from tiny_models import build_tokenizer
    from transformers import GPT2Config

    from kernel.sequences import pad_id_of

    tok = build_tokenizer()
    assert pad_id_of(tok) == tok.pad_token_id == 0
    tok.pad_token = None
    assert pad_id_of(tok) == tok.eos_token_id == 2
    assert pad_id_of(GPT2Config(pad_token_id=4, eos_token_id=2)) == 4
    assert pad_id_of(GPT2Config(pad_token_id=None, eos_token_id=2)) == 2
    assert pad_id_of(GPT2Config(pad_token_id=None, eos_token_id=[6, 2, 3])) == 2


@pytest.mark.parametrize("with_pad", [True, False])
def test_driver_engine_and_reference_pad_with_one_id(tmp_path, with_pad):
    """The learner's pad (the driver's, from the tokenizer), the rollout engine's and the reference's
    are one id, whether the checkpoint names a pad or only an EOS."""
    from tiny_models import build_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    from cluster.prompts.loader import pad_token_id
    from reward_service.config import ReferenceConfig
    from reward_service.reference import ReferencePolicy
    from rollout_workers.engine import read_special_ids

    tok = build_tokenizer()
    if not with_pad:
        tok.pad_token = None
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=16, n_embd=8, n_layer=1, n_head=2,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    want = 0 if with_pad else 2
    assert pad_token_id(tok) == want
    assert read_special_ids(str(tmp_path))[1] == want
    assert ReferencePolicy(str(tmp_path), ReferenceConfig()).pad_id == want


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "llama"])
def test_right_padded_batch_computes_each_sequences_own_logprobs(tmp_path, family):
    """The probe's batched forward (`right_padded`): each row's teacher-forced logprobs equal the
    sequence's alone (float32; a different matmul shape rounds differently, far below 1e-5)."""
    from tiny_models import build_causal_lm
    from transformers import AutoModelForCausalLM

    from kernel.sequences import probe_sequences, right_padded, sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(build_causal_lm(tmp_path / family, family)).eval()
    sequences = probe_sequences(model.config.vocab_size)
    assert len({len(s) for s in sequences}) > 1  # padding is exercised
    ids, mask = right_padded(sequences)
    assert ids.shape == (len(sequences), max(len(s) for s in sequences))
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).logits
        for row, seq in enumerate(sequences):
            one = torch.as_tensor(seq).unsqueeze(0)
            alone = sequence_logprobs(model(input_ids=one).logits[0], one[0])
            n = len(seq)
            assert mask[row].sum() == n and (ids[row, n:] == 0).all()
            got = sequence_logprobs(batched[row, :n], ids[row, :n])
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
