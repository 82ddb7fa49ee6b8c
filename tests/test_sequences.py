"""Token alignment: outputs at positions p-1 .. p+r-2 score a response that starts at p."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.sequences import gather_response, pack_sequences, response_positions, response_tokens


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


def test_fused_tanh_gelu_matches_transformers_gelu_new():
    from transformers.activations import NewGELUActivation

    from learner.sequences import TanhGELU, fuse_tanh_gelu

    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(TanhGELU()(x), NewGELUActivation()(x), atol=1e-6, rtol=0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 3), NewGELUActivation(), torch.nn.Sequential(NewGELUActivation())
    )
    assert fuse_tanh_gelu(model) == 2
    assert not any(isinstance(m, NewGELUActivation) for m in model.modules())


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "llama"])
def test_right_padded_batch_computes_each_sequences_own_logprobs(tmp_path, family):
    """The probe's batched forward (`right_padded`): each row's teacher-forced logprobs equal the
    sequence's alone (float32; a different matmul shape rounds differently, far below 1e-5)."""
    from tiny_models import build_causal_lm
    from transformers import AutoModelForCausalLM

    from learner.sequences import probe_sequences, right_padded, sequence_logprobs

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
