"""RewardScorer: a real sequence-classification model against a direct forward of the same texts, and
reward functions' weighted sum beside each function's own values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import _config, build_tokenizer
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPT2ForSequenceClassification

from reward_service.config import RewardConfig
from reward_service.scorer import RewardScorer

TEXTS = [
    ("the movie was", "great and fun ."),
    ("i", "hated it"),
    ("the acting was very", "bad but the story was good and the plot was not boring ."),
    ("a film", "."),
]


def _ids(tokenizer, texts):
    prompts = [np.array(tokenizer.encode(p), dtype=np.int64) for p, _ in texts]
    # The policy's special tokens (bos/eos) must not reach the reward model's text.
    responses = [np.array(tokenizer.encode(r) + [tokenizer.eos_token_id], dtype=np.int64) for _, r in texts]
    prompts = [np.concatenate([[tokenizer.bos_token_id], p]) for p in prompts]
    return prompts, responses


def _direct_logits(model_dir: Path, texts: list[str]) -> torch.Tensor:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    limit = model.config.n_positions
    rows = []
    with torch.no_grad():
        for t in texts:  # one at a time: no padding involved at all
            ids = torch.tensor([tok(t)["input_ids"][:limit]])
            rows.append(model(input_ids=ids).logits[0])
    return torch.stack(rows)


@pytest.mark.parametrize(
    "score,positive_label", [("logit", 1), ("logit", 0), ("logit_diff", 1), ("logit_diff", 0), ("prob", 1)]
)
def test_model_scores_equal_direct_forward(tiny_policy_dir, tiny_reward_dir, score, positive_label):
    tok = build_tokenizer()
    prompts, responses = _ids(tok, TEXTS)
    cfg = RewardConfig(
        kind="model",
        model_path=str(tiny_reward_dir),
        score=score,
        positive_label=positive_label,
        batch_size=3,
    )
    scorer = RewardScorer(cfg, str(tiny_policy_dir))
    out = scorer.score(prompts, responses)

    logits = _direct_logits(tiny_reward_dir, [f"{p} {r}" for p, r in TEXTS])
    if score == "logit":
        want = logits[:, positive_label]
    elif score == "logit_diff":
        want = logits[:, positive_label] - logits[:, 1 - positive_label]
    else:
        want = torch.softmax(logits, -1)[:, positive_label]
    assert out.ok.all() and out.errors == [None] * len(TEXTS)
    assert out.scores.dtype == np.float32
    np.testing.assert_allclose(out.scores, want.numpy(), atol=1e-5, rtol=0)
    assert scorer.stats()["samples"] == len(TEXTS) and scorer.stats()["failures"] == 0


def test_no_pad_token_and_right_truncation(tiny_policy_dir, tmp_path):
    """A reward model without a pad id still batches, and texts past its positions are cut on the right."""
    tok = build_tokenizer()
    torch.manual_seed(3)
    cfg = _config(tok, n_layer=1, n_embd=16)
    cfg.num_labels, cfg.n_positions, cfg.pad_token_id = 2, 12, None
    GPT2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None

    texts = TEXTS + [("the movie", " ".join(["very"] * 20) + " good")]  # 23 words > 12 positions
    prompts, responses = _ids(tok, texts)
    scorer = RewardScorer(
        RewardConfig(kind="model", model_path=str(tmp_path), score="logit"), str(tiny_policy_dir)
    )
    out = scorer.score(prompts, responses)
    logits = _direct_logits(tmp_path, [f"{p} {r}" for p, r in texts])
    assert out.ok.all()
    np.testing.assert_allclose(out.scores, logits[:, 1].numpy(), atol=1e-5, rtol=0)


def test_forward_failure_fails_whole_batch_only(tiny_policy_dir, tmp_path):
    """A tokenizer/model vocabulary mismatch makes the forward raise: that batch fails, the others score."""
    tok = build_tokenizer()
    cfg = _config(tok, n_layer=1, n_embd=16)
    cfg.num_labels, cfg.vocab_size = 2, 10  # ids >= 10 ("terrible", "plot", ...) are out of range
    GPT2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    texts = [("the movie", "was great"), ("the", "plot was terrible .")]  # 4 vs 6 tokens
    prompts, responses = _ids(tok, texts)

    one = RewardScorer(
        RewardConfig(kind="model", model_path=str(tmp_path), batch_size=1), str(tiny_policy_dir)
    )
    out = one.score(prompts, responses)
    assert out.ok.tolist() == [True, False]
    assert np.isfinite(out.scores[0]) and np.isnan(out.scores[1])
    assert out.errors[0] is None and "reward model forward failed: IndexError" in out.errors[1]

    both = RewardScorer(
        RewardConfig(kind="model", model_path=str(tmp_path), batch_size=2), str(tiny_policy_dir)
    )
    out = both.score(prompts, responses)
    assert not out.ok.any() and np.isnan(out.scores).all()
    assert all("reward model forward failed" in e for e in out.errors)
    assert both.stats()["failures"] == 2


def test_config_errors_name_the_problem(tiny_policy_dir, tiny_reward_dir):
    with pytest.raises(ValueError, match="model_path"):
        RewardScorer(RewardConfig(kind="model"), str(tiny_policy_dir))
    with pytest.raises(ValueError, match="positive_label=5"):
        RewardScorer(RewardConfig(model_path=str(tiny_reward_dir), positive_label=5), str(tiny_policy_dir))
    with pytest.raises(ValueError, match="reward.rule"):
        RewardScorer(RewardConfig(kind="rule"), str(tiny_policy_dir))
    with pytest.raises(ValueError, match="reward.url"):
        RewardScorer(RewardConfig(kind="remote"), str(tiny_policy_dir))
    scorer = RewardScorer(RewardConfig(model_path=str(tiny_reward_dir)), str(tiny_policy_dir))
    with pytest.raises(ValueError, match="2 prompts, 1 responses"):
        scorer.score([np.array([4]), np.array([5])], [np.array([6])])


def test_reward_functions_keep_their_own_values_beside_the_weighted_sum(tiny_policy_dir):
    """Two shipped rules as reward.functions: the score is 2 * keywords + 1 * length penalty, and the
    scorer's record carries each function's own (unweighted) values; a sample one function cannot judge
    fails with that function's message, the other function's value kept beside it."""
    tok = build_tokenizer()
    prompts, responses = _ids(tok, TEXTS[:3])
    functions = [{"name": "contains_keyword", "weight": 2.0}, {"name": "length_penalty", "weight": 1.0}]
    scorer = RewardScorer(RewardConfig(kind="rule", functions=functions), str(tiny_policy_dir))
    meta = [
        {"keywords": ["great", "plot"], "max_words": 2},  # "great and fun ." : 1/2, -(4-2)/2
        {"keywords": ["it"], "max_words": 5},  # "hated it": 1, 0
        {"keywords": ["story"]},  # no max_words: length_penalty raises
    ]
    out = scorer.score(prompts, responses, meta, finish_reasons=["stop"] * 3)
    assert out.ok.tolist() == [True, True, False]
    np.testing.assert_allclose(out.scores[:2], [2 * 0.5 - 1.0, 2 * 1.0 + 0.0])
    np.testing.assert_allclose(out.function_values["contains_keyword"], [0.5, 1.0, 1.0])
    np.testing.assert_allclose(out.function_values["length_penalty"], [-1.0, 0.0, np.nan])
    assert (
        out.errors[2]
        == "reward function 'length_penalty' raised KeyError: \"rule length_penalty needs meta['max_words']\""
    )
    assert scorer.stats()["failures"] == 1
