"""Rule rewards: the registry, the shipped rules, and per-sample failure reporting through the scorer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tiny_models import build_tokenizer

from reward_service.config import RewardConfig
from reward_service.rules import get_reward, list_rewards, normalize_answer, register_reward
from reward_service.scorer import RewardScorer


@pytest.mark.parametrize(
    "response,answer,want",
    [
        ("so the answer is 42.", "42", 1.0),
        ("3 apples plus 4 apples make 7 apples", 7, 1.0),
        ("first 12, then 13", "12", 0.0),  # the LAST number counts
        ("#### 1,000", "1000", 1.0),
        ("total: $3.50", "3.5", 1.0),
        ("it is 0.5", "1/2", 1.0),
        ("x = 2.0", "2", 1.0),
        ("the result is \\boxed{-3} (check: 5)", "-3", 1.0),  # \boxed wins over later numbers
        ("\\boxed{\\text{Paris}}", "paris", 1.0),
        ("I do not know", "4", 0.0),
        ("41", "42", 0.0),
    ],
)
def test_exact_match(response, answer, want):
    assert get_reward("exact_match")("q", response, {"answer": answer}) == want


def test_shipped_rules():
    boxed = get_reward("format_boxed")
    assert boxed("", "so \\boxed{x^{2}}", {"answer": "x^{2}"}) == 1.0
    assert boxed("", "so \\boxed{3}", {"answer": "4", "format_score": 0.1}) == pytest.approx(0.1)
    assert boxed("", "it is 4", {"answer": "4"}) == 0.0
    kw = get_reward("contains_keyword")
    assert kw("", "The Movie was GREAT", {"keywords": ["great", "movie", "plot"]}) == pytest.approx(2 / 3)
    assert kw("", "greatness", {"keywords": ["great"]}) == 0.0  # whole words only
    lp = get_reward("length_penalty")
    assert lp("", "a b c", {"max_words": 4}) == 0.0
    assert lp("", "a b c d e f", {"max_words": 4}) == pytest.approx(-0.5)
    assert normalize_answer(" 1,234. ") == "1234" and normalize_answer("inf") == "inf"


def test_missing_meta_raises_instead_of_scoring_zero():
    with pytest.raises(KeyError, match="answer"):
        get_reward("exact_match")("q", "42", {})
    with pytest.raises(KeyError, match="keywords"):
        get_reward("contains_keyword")("q", "42", {"keywords": "great"})


def test_registry_lookup_and_duplicates():
    assert {"exact_match", "format_boxed", "contains_keyword", "length_penalty"} <= set(list_rewards())
    with pytest.raises(ValueError) as e:
        get_reward("no_such_rule")
    assert "no_such_rule" in str(e.value) and "exact_match" in str(e.value) and "format_boxed" in str(e.value)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("exact_match")(lambda p, r, m: 0.0)


@register_reward("_test_picky")
def _picky(prompt: str, response: str, meta: dict) -> float:
    mode = meta.get("mode")
    if mode == "raise":
        raise RuntimeError("cannot judge this one")
    if mode == "nan":
        return math.nan
    if mode == "inf":
        return -math.inf
    if mode == "str":
        return "1.0"  # type: ignore[return-value]
    if mode == "bool":
        return True  # type: ignore[return-value]
    return float(len(response.split()))


def _encode(tok, words: list[str]) -> list[np.ndarray]:
    return [np.array(tok.encode(w), dtype=np.int64) for w in words]


def test_failing_rule_samples_are_reported_and_others_scored(tiny_policy_dir):
    tok = build_tokenizer()
    responses = ["great", "the movie", "bad", "a b", "very good fun", "it", "boring"]
    modes = ["ok", "raise", "ok", "nan", "ok", "str", "inf"]
    prompts = _encode(tok, ["the movie was"] * len(responses))
    scorer = RewardScorer(RewardConfig(kind="rule", rule="_test_picky"), str(tiny_policy_dir))
    out = scorer.score(prompts, _encode(tok, responses), [{"mode": m} for m in modes])

    assert out.ok.tolist() == [m == "ok" for m in modes]
    np.testing.assert_array_equal(out.scores[out.ok], [1.0, 1.0, 3.0])
    assert np.isnan(out.scores[~out.ok]).all()  # never a silent 0
    assert "RuntimeError: cannot judge this one" in out.errors[1]
    assert "non-finite" in out.errors[3] and "non-finite" in out.errors[6]
    assert "not a number" in out.errors[5]
    assert [e is None for e in out.errors] == out.ok.tolist()
    assert scorer.stats()["failures"] == 4 and scorer.stats()["samples"] == 7


def test_rule_module_from_file_and_decoded_text(tiny_policy_dir, tmp_path):
    """A user rule registered by a .py file named in the config sees the decoded text, specials removed."""
    path = tmp_path / "my_rules.py"
    path.write_text(
        "from reward_service.rules import register_reward\n\n"
        "@register_reward('_test_user_echo')\n"
        "def echo(prompt, response, meta):\n"
        "    return float(prompt == meta['prompt'] and response == meta['response'])\n"
    )
    cfg = RewardConfig(kind="rule", rule="_test_user_echo", rule_module=str(path))
    tok = build_tokenizer()
    prompt = np.array([tok.bos_token_id, *tok.encode("the film")], dtype=np.int64)
    response = np.array([*tok.encode("was fun"), tok.eos_token_id], dtype=np.int64)
    out = RewardScorer(cfg, str(tiny_policy_dir)).score(
        [prompt], [response], [{"prompt": "the film", "response": "was fun"}]
    )
    assert out.ok.all() and out.scores.tolist() == [1.0]
    RewardScorer(cfg, str(tiny_policy_dir))  # loading the same file again is harmless
    with pytest.raises(ValueError, match="does not exist"):
        RewardScorer(cfg.model_copy(update={"rule_module": str(tmp_path / "nope.py")}), str(tiny_policy_dir))
    broken = tmp_path / "broken_rules.py"
    broken.write_text("raise RuntimeError('typo in my rules')\n")
    with pytest.raises(ValueError, match="typo in my rules"):
        get_reward("_test_user_echo", str(broken))
    assert get_reward("_test_user_echo", str(path)) is get_reward("_test_user_echo")
    with pytest.raises(ValueError, match="cannot import"):
        RewardScorer(cfg.model_copy(update={"rule_module": "no_such_pkg.rules"}), str(tiny_policy_dir))


@pytest.mark.parametrize(
    "response,answer,want",
    [
        ("47", "47", 1.0),
        (" 47 ", 47, 1.0),  # surrounding spaces are not part of the answer
        ("047", "47", 1.0),  # the parsed number counts
        ("+47", "47", 1.0),
        ("-3", "-3", 1.0),
        ("46", "47", 0.0),
        ("4 7", "47", 0.0),  # malformed answers are wrong, never errors
        ("12+47", "47", 0.0),
        ("47=", "47", 0.0),
        ("47.0", "47", 0.0),
        ("", "47", 0.0),
        ("+=+", "47", 0.0),
        ("٤٧", "47", 0.0),  # ASCII digits only
        ("4" * 40, "47", 0.0),
    ],
)
def test_exact_integer_parses_the_whole_response(response, answer, want):
    assert get_reward("exact_integer")("12+35=", response, {"answer": answer}) == want


def test_exact_integer_needs_the_answer_in_meta():
    with pytest.raises(KeyError, match="answer"):
        get_reward("exact_integer")("1+1=", "2", {})
