"""Learner, reference and hf generator agree on every architecture's logits (fp32, tolerance 1e-5).

Tiny causal LMs built from configs of eight families (tests/tiny_models.FAMILIES; two mixtures of experts,
Qwen3-MoE and Mixtral, docs/moe.md): the hf generator
samples responses with their behaviour logprobs; the reference and the learner (PolicyWithValueHead,
the forward training uses) rescore the same tokens; an unpadded full forward of the HF model is the
independent check. Gemma2 (final softcap), Granite (`logits_scaling`) and Cohere (`logit_scale`)
apply their own output scaling, which a hand-made backbone -> lm_head path misses (checked too, so
the test would catch that mistake), and the value head must read the post-final-norm hidden state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version
from tiny_models import FAMILIES, build_causal_lm
from transformers import AutoModelForCausalLM

import kernel.sequences as sequences
from learner.model import PolicyWithValueHead
from learner.ppo_step import forward_scores, pack_trajectories
from learner.trajectory import Trajectory
from reward_service.config import ReferenceConfig
from reward_service.reference import ReferencePolicy
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.hf_engine import HFEngine

TOL = 1e-5
TEMPERATURE = 0.7
PROMPTS = [np.array([1, 5, 6]), np.array([1]), np.array([1, 9, 10, 11, 12, 13, 14])]
SCALED = {"gemma2", "granite", "cohere"}  # families whose logits are not just lm_head(hidden)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, build_causal_lm(tmp_path_factory.mktemp(request.param), request.param, seed=3)


def _generate(path):
    engine = HFEngine(str(path), RolloutConfig())
    sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=6)
    outs = [o[0] for o in engine.generate(PROMPTS, sampling, seed=11)]
    return [o.response_ids for o in outs], [o.logprobs for o in outs]


def _learner(model, responses):
    trajs = [
        Trajectory(p, r, np.zeros(len(r), np.float32), np.zeros(len(r), np.float32), 0.0)
        for p, r in zip(PROMPTS, responses, strict=True)
    ]
    b = pack_trajectories(trajs, pad_id=0)
    with torch.no_grad():
        lp, values, _ = forward_scores(model, b, TEMPERATURE)
    return [lp[i, : len(r)].numpy() for i, r in enumerate(responses)], values


def _unpadded(model, prompt, response, head=None):
    """logprobs (and, with `head`, lm_head(last hidden) logprobs and the last hidden) of one row."""
    ids = torch.from_numpy(np.concatenate([prompt, response]))[None]
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    tok = torch.from_numpy(response)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, pos]
        hidden = model.base_model(input_ids=ids).last_hidden_state[0, pos]
        raw = model.get_output_embeddings()(hidden)
    own = torch.log_softmax(logits / TEMPERATURE, -1)[torch.arange(len(tok)), tok].numpy()
    hand = torch.log_softmax(raw / TEMPERATURE, -1)[torch.arange(len(tok)), tok].numpy()
    return own, hand, hidden


def test_learner_reference_and_generator_logprobs_agree(family_dir):
    family, path = family_dir
    responses, behaviour = _generate(path)
    assert any(len(r) > 1 for r in responses)
    reference = ReferencePolicy(str(path), ReferenceConfig(batch_size=2), temperature=TEMPERATURE)
    ref = reference.logprobs(PROMPTS, responses)
    model = PolicyWithValueHead.from_pretrained(path, value_head_std=0.5, seed=1).eval()
    learner, values = _learner(model, responses)
    # chunked from the hidden states where the model qualifies (`auto`), its own logits elsewhere
    chunked = PolicyWithValueHead.from_pretrained(
        path, value_head_std=0.5, seed=1, logits_chunk_tokens="auto"
    )
    assert (chunked.eval().logits_chunk_tokens is None) == (family in SCALED)
    learner_auto, _ = _learner(chunked, responses)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    max_hand_gap = 0.0
    for i, (p, r) in enumerate(zip(PROMPTS, responses, strict=True)):
        own, hand, hidden = _unpadded(hf, p, r)
        np.testing.assert_allclose(learner[i], own, atol=TOL, rtol=0)
        np.testing.assert_allclose(learner_auto[i], own, atol=TOL, rtol=0)
        np.testing.assert_allclose(ref[i], own, atol=TOL, rtol=0)
        np.testing.assert_allclose(behaviour[i], own, atol=TOL, rtol=0)
        # The value head reads the final-norm output (the lm_head's input) at the same positions.
        with torch.no_grad():
            expected_v = model.value_head(hidden).squeeze(-1)
        torch.testing.assert_close(values[i, : len(r)], expected_v, atol=TOL, rtol=0)
        max_hand_gap = max(max_hand_gap, float(np.abs(hand - own).max()))
    if family in SCALED:
        assert max_hand_gap > 0.05, f"{family}: lm_head(hidden) should differ from the model's own logits"
    else:
        assert max_hand_gap < TOL


def test_per_row_positions_and_tail_fallback_give_the_same_logits(family_dir, monkeypatch):
    _, path = family_dir
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    responses = [np.array([4, 5]), np.array([6, 7, 8, 9]), np.array([10])]
    ids, attn, p_lens, _ = sequences.pack_sequences(PROMPTS, responses, 0)
    if Version(transformers.__version__) >= Version("5.23"):  # 5.19 (the vLLM venv's) takes the tail path
        assert sequences.keeps_positions_per_row(type(hf))
    with torch.no_grad():
        rows, _ = sequences.response_logits(hf, ids, attn, p_lens, 4)
        monkeypatch.setattr(sequences, "keeps_positions_per_row", lambda cls: False)
        tail, _ = sequences.response_logits(hf, ids, attn, p_lens, 4)
        full = sequences.gather_response(hf(input_ids=ids, attention_mask=attn).logits, p_lens, 4)
    assert rows.shape == tail.shape == (3, 4, hf.config.vocab_size)
    torch.testing.assert_close(rows, full, atol=TOL, rtol=0)
    torch.testing.assert_close(tail, full, atol=TOL, rtol=0)


def test_a_model_without_logits_to_keep_is_projected_in_full():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, use_cache=None):
            logits = torch.nn.functional.one_hot(input_ids, 5).float()
            return type("Out", (), {"logits": logits})()

    assert not sequences.keeps_positions_per_row(Plain)
    ids = torch.tensor([[1, 2, 3, 0], [4, 3, 2, 1]])
    logits, _ = sequences.response_logits(Plain(), ids, torch.ones_like(ids), torch.tensor([2, 1]), 2)
    # row 0 scores from position 1 (tokens 2, 3), row 1 from position 0 (tokens 4, 3)
    assert logits.argmax(-1).tolist() == [[2, 3], [4, 3]]
