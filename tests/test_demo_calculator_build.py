"""The calculator demo's offline build: its tokenizer (tool tags as single ordinary tokens), problem split
and corpus mix, the calculator's safe evaluator, the episode loop the build evaluates with, its band,
and a real build from one seed (slow)."""

from __future__ import annotations

import json
import re

import pytest

import demos
from demos.calculator import (
    BAND,
    EVAL_SAMPLES,
    STOP_IDS,
    AssetPaths,
    Band,
    BuildQualityError,
    ensure_assets,
    hf_turns,
)
from demos.calculator_corpus import (
    BAD_KINDS,
    BAD_TOOL_FRAC,
    CALL_CLOSE_ID,
    CALL_OPEN_ID,
    DIRECT_CORRECT_FRAC,
    KINDS,
    N_EVAL,
    N_POSITIONS,
    N_RL,
    N_VAL,
    RESULT_CLOSE_ID,
    RESULT_OPEN_ID,
    SHORT_PRODUCT_FRAC,
    TOOL_FRAC,
    Episode,
    calc,
    char_tokenizer,
    corpus,
    encode,
    episode_metrics,
    near_miss,
    observation,
    run_episodes,
    split_problems,
)
from demos.common import BOS_ID, EOS_ID, PAD_ID, read_manifest

TRANSCRIPT = re.compile(
    r"(\d+)\*(\d+)=(?:<calc>([^<]*)(</calc><result>(-?\d+)</result>)?)?(\d*)"
)  # prompt, call expression, closed call + result, answer


def test_tool_tags_are_single_ordinary_tokens():
    tok = char_tokenizer()
    call = tok.encode("<calc>37*48</calc>", add_special_tokens=False)
    assert len(call) == 7 and (call[0], call[-1]) == (CALL_OPEN_ID, CALL_CLOSE_ID)
    assert tok.convert_ids_to_tokens(call) == ["<calc>", "3", "7", "*", "4", "8", "</calc>"]
    result = tok.encode("<result>1776</result>", add_special_tokens=False)
    assert result[0] == RESULT_OPEN_ID and result[-1] == RESULT_CLOSE_ID and BOS_ID not in result
    assert tok.decode(call) == "<calc>37*48</calc>"
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2) and len(tok) == 21
    assert set(tok.all_special_ids) == {PAD_ID, BOS_ID, EOS_ID}  # the tags are not special
    text = "37*48=<calc>37*48</calc><result>1776</result>1776"
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and len(ids) == 1 + 6 + 7 + 6 + 4
    assert tok.decode([*ids, EOS_ID, PAD_ID], skip_special_tokens=True) == text  # tags kept, specials dropped
    assert len(encode(tok, [text])[0][0]) <= N_POSITIONS


def test_encode_appends_eos_and_marks_the_observation_as_the_environments():
    tok = char_tokenizer()
    (ids,), (env,) = encode(tok, ["12*10=<calc>12*10</calc><result>120</result>120"])
    assert ids[-1] == EOS_ID
    marked = [t for t, m in zip(ids, env, strict=True) if m]
    assert tok.decode(marked) == "<result>120</result>"
    (_,), (env,) = encode(tok, ["12*10=119"])
    assert not any(env)


def test_split_is_a_seeded_partition_of_all_problems():
    held_out, rl, pre_only = split_problems(0)
    assert (len(held_out), len(rl)) == (N_EVAL, N_RL) and len(pre_only) > N_VAL
    every = set(held_out) | set(rl) | set(pre_only)
    assert len(every) == len(held_out) + len(rl) + len(pre_only) == 90 * 90
    assert min(min(p) for p in every) == 10 and max(max(p) for p in every) == 99
    assert split_problems(0) == (held_out, rl, pre_only) and split_problems(1)[0] != held_out


def test_corpus_mix_and_every_transcript_is_consistent_with_the_calculator():
    held_out, rl, pre_only = split_problems(0)
    n = 20_000
    examples = corpus("0", rl + pre_only[N_VAL:], n)
    assert corpus("0", rl + pre_only[N_VAL:], 50) == examples[:50] and corpus("1", rl, 50) != examples[:50]
    counts = dict.fromkeys(KINDS, 0)
    direct_right = 0
    for kind, text in examples:
        counts[kind] += 1
        m = TRANSCRIPT.fullmatch(text)
        assert m, text
        a, b, expr, closed, result, answer = m.groups()
        a, b = int(a), int(b)
        assert (a, b) not in set(held_out) | set(pre_only[:N_VAL])  # neither held-out nor selection
        if kind == "direct":
            assert expr is None and answer
            direct_right += int(answer) == a * b
        elif kind == "no_close":
            assert expr == f"{a}*{b}" and closed is None and not answer
        else:
            assert int(result) == calc(expr)  # a closed call is always answered by the calculator
            assert (expr == f"{a}*{b}") == (kind != "wrong_operand")
            assert (answer == result) == (kind != "copy_error")
    share = {k: v / n for k, v in counts.items()}  # binomial sd <= 0.0035
    assert share["tool"] == pytest.approx(TOOL_FRAC, abs=0.015)
    for kind, s in BAD_KINDS.items():
        assert share[kind] == pytest.approx(BAD_TOOL_FRAC * s, abs=0.006)
    assert share["direct"] == pytest.approx(1 - TOOL_FRAC - BAD_TOOL_FRAC, abs=0.015)
    assert direct_right / counts["direct"] == pytest.approx(DIRECT_CORRECT_FRAC, abs=0.02)
    short = sum(int(a) * int(b) < 1000 for _, t in examples for a, b in [t.split("=")[0].split("*")]) / n
    assert short == pytest.approx(SHORT_PRODUCT_FRAC, abs=0.015)


def test_near_miss_is_never_the_value():
    import random

    rng = random.Random(0)
    for value in [0, 1, 9, 100, 1776, 9801]:
        misses = {near_miss(rng, value) for _ in range(200)}
        assert value not in misses and min(misses) >= 0


@pytest.mark.parametrize(
    "expr,value", [("37*48", 1776), ("7", 7), ("1+2*3-4", 3), ("3-48", -45), ("2*3*4+1", 25), ("007", 7)]
)
def test_calc_evaluates_integers_with_plus_minus_times(expr, value):
    assert calc(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "",
        "-3",
        "1+",
        "2**3",
        "(1+2)",
        "6/3",
        "1 + 2",
        "1.5*2",
        "__import__('os')",
        "٣*2",  # ASCII digits only
        "1" * 40,  # too long
    ],
)
def test_calc_refuses_anything_else(expr):
    with pytest.raises(ValueError, match="not a calculator expression"):
        calc(expr)


def test_observation_only_for_a_turn_ending_in_a_well_formed_call():
    assert observation("<calc>37*48</calc>") == "<result>1776</result>"
    assert observation("12<calc>3-5</calc>") == "<result>-2</result>"
    for turn in ["1776", "<calc>37*48", "37*48</calc>", "<calc>37/48</calc>", "<calc></calc>", ""]:
        assert observation(turn) is None, turn


def test_calls_and_answers_read_as_the_rollout_tool_environment_reads_them():
    """The build's loop stands in for `rollout_workers.tools.ToolEnvironment` (the RL run's): the same
    observation for a well-formed call, the same verdict on a final turn."""
    from rollout_workers.tools import ToolEnvironment

    env = ToolEnvironment()
    state = env.reset("37*48=", {"answer": "1776"})
    for turn in ["<calc>37*48</calc>", "<calc>3-48</calc>", "<calc>12*3*4+1</calc>", "9<calc>99*99</calc>"]:
        assert env.step(turn, state).observation == observation(turn)
    for turn in ["1776", "=1776", "1+1776", "1775", "17761", "", "-1776", "1776</calc>", "1776<calc>1"]:
        step = env.step(turn, state)
        assert (step.reward == 1.0) == Episode((37, 48), [], [turn]).correct, turn


def _stub_sampler(tok, script):
    """A hand-made policy: each stream's next turn is looked up by its prompt and turn number."""

    def sample(streams):
        out = []
        for s in streams:
            text = tok.decode(s, skip_special_tokens=True)
            prompt = text.split("=")[0] + "="
            turn = script[prompt][text.count("<result>")]  # an episode goes on only after an observation
            out.append(
                tok.encode(turn, add_special_tokens=False) + ([] if turn.endswith("</calc>") else [EOS_ID])
            )
        return out

    return sample


def test_run_episodes_puts_the_calculator_in_the_loop():
    tok = char_tokenizer()
    script = {
        "37*48=": ["<calc>37*48</calc>", "1776"],  # the tool used right
        "12*10=": ["120"],  # a right direct answer
        "17*10=": ["=-12+170"],  # its last integer answers, as the environment reads it
        "11*11=": ["122"],  # a wrong one
        "13*13=": ["<calc>13*13"],  # a call never closed: the turn ends at <eos>
        "14*14=": ["<calc>14*14</calc>", "<calc>196</calc>", "<calc>196</calc>"],  # calls until cut off
        "15*15=": ["<calc>15*16</calc>", "240"],  # the wrong operand, faithfully copied
        "16*16=": ["<calc>16**16</calc>"],  # malformed: no observation, the episode ends
    }
    pairs = [tuple(int(x) for x in p[:-1].split("*")) for p in script]
    eps = run_episodes(_stub_sampler(tok, script), tok, pairs, max_turns=3)
    by = {e.pair: e for e in eps}
    tool = by[(37, 48)]
    assert tok.decode(tool.ids) == "<bos>37*48=<calc>37*48</calc><result>1776</result>1776<eos>"
    assert (tool.turns, tool.calls, tool.answer, tool.correct) == (
        ["<calc>37*48</calc>", "1776"],
        1,
        "1776",
        True,
    )
    assert by[(12, 10)].correct and by[(12, 10)].calls == 0 and not by[(11, 11)].correct
    assert by[(17, 10)].correct and by[(17, 10)].answer == "=-12+170"
    assert (by[(13, 13)].calls, by[(13, 13)].malformed, by[(13, 13)].correct) == (0, 1, False)
    loop = by[(14, 14)]
    assert (len(loop.turns), loop.calls, loop.correct) == (3, 3, False)
    assert tok.decode(loop.ids).count("<result>") == 2  # no observation after the last turn
    assert (
        by[(15, 15)].calls == 1
        and not by[(15, 15)].correct
        and "<result>240</result>" in tok.decode(by[(15, 15)].ids)
    )
    assert (by[(16, 16)].calls, by[(16, 16)].malformed, len(by[(16, 16)].turns)) == (0, 1, 1)
    m = episode_metrics(eps)
    assert m == pytest.approx(
        {
            "accuracy": 3 / 8,
            "tool_call_rate": 3 / 8,
            "accuracy_given_call": 1 / 3,
            "malformed_call_rate": 2 / 8,
        }
    )


def test_hf_turns_end_at_a_stop_token_or_the_turn_limit():
    import torch
    from transformers import GPT2LMHeadModel

    from demos.common import gpt2_config

    tok = char_tokenizer()
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(
        gpt2_config(len(tok), n_layer=1, n_embd=16, n_head=2, n_positions=N_POSITIONS)
    ).eval()
    with torch.no_grad():  # make </calc> likely, so that turns of both kinds come out
        lm.lm_head.weight[CALL_CLOSE_ID] += 0.3
    streams = [tok("37*48=").input_ids, tok("37*48=<calc>37*48</calc><result>1776</result>").input_ids] * 20
    for greedy in (False, True):
        turns = hf_turns(lm, greedy=greedy, max_new_tokens=5)(streams)
        assert len(turns) == len(streams)
        for t in turns:
            assert 1 <= len(t) <= 5 and not set(t[:-1]) & set(STOP_IDS)
            assert t[-1] in STOP_IDS or len(t) == 5
    assert any(t[-1] == CALL_CLOSE_ID for t in hf_turns(lm, greedy=False, max_new_tokens=5)(streams))


def test_band_names_itself_and_what_missed():
    good = {
        "held_out_sampled_accuracy": 0.25,
        "held_out_sampled_tool_call_rate": 0.27,
        "held_out_sampled_accuracy_given_call": 0.92,
    }
    assert BAND.misses(good) == []
    BAND.check(good, seed=0, lm_steps=10)
    band = Band(sampled_max=0.3, call_rate_min=0.1, call_rate_max=0.6, given_call_min=0.85)
    bad = {
        "held_out_sampled_accuracy": 0.45,
        "held_out_sampled_tool_call_rate": 0.05,
        "held_out_sampled_accuracy_given_call": 0.5,
    }
    assert band.misses(bad) == [
        "held-out sampled accuracy 0.450 > 0.3",
        "tool-call rate 0.050 outside [0.1, 0.6]",
        "accuracy given a call 0.500 < 0.85",
    ]
    with pytest.raises(BuildQualityError, match=r"missed its quality band .*tool-call rate 0\.050"):
        band.check(bad, seed=3, lm_steps=10)


def test_the_demo_is_registered():
    assert demos.DEMOS["calculator"] == "demos.calculator"


def test_a_build_that_misses_the_band_fails_and_publishes_nothing(tmp_path):
    root = tmp_path / "calculator_tiny"
    with pytest.raises(BuildQualityError, match="missed its quality band"):
        ensure_assets(root, lm_steps=5, quiet=True)
    assert not root.exists() or not any(root.iterdir())


def test_a_quick_build_writes_loadable_disjoint_prompt_files(tmp_path):
    """Few pretraining steps: the mechanics, not the quality, are under test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = ensure_assets(tmp_path / "calculator_tiny", lm_steps=5, check_band=False, quiet=True)
    assert isinstance(a, AssetPaths)
    train = [json.loads(x) for x in a.prompts.read_text().splitlines()]
    held = [json.loads(x) for x in a.eval_prompts.read_text().splitlines()]
    assert (len(train), len(held)) == (N_RL, N_EVAL)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert held[0].keys() == {"prompt", "answer"} and re.fullmatch(r"\d\d\*\d\d=", held[0]["prompt"])
    assert all(int(r["answer"]) == calc(r["prompt"][:-1]) for r in held)
    lm = AutoModelForCausalLM.from_pretrained(a.policy, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(a.policy, local_files_only=True)
    assert lm.config.vocab_size == len(tok) == 21 and lm.config.n_positions == N_POSITIONS
    assert tok.encode("<calc>37*48</calc>", add_special_tokens=False) == [17, 6, 10, 15, 7, 11, 18]
    assert lm.generation_config.eos_token_id == EOS_ID
    m = read_manifest(a.root)
    assert m["lm_steps"] == 5 and (m["band_checked"], m["band"], m["selection"]["step"]) == (False, None, 5)
    assert m["tool_token_ids"] == {"<calc>": 17, "</calc>": 18, "<result>": 19, "</result>": 20}
    assert 0.0 <= m["metrics"]["held_out_sampled_accuracy"] <= 1.0
    assert m["episode"]["eval_samples"] == EVAL_SAMPLES and m["episode"]["stop_token_ids"] == [EOS_ID, 18]
    assert m["corpus_mix"]["bad_kinds"] == BAD_KINDS and (m["tool_frac"], m["bad_frac"]) == (
        TOOL_FRAC,
        BAD_TOOL_FRAC,
    )
    assert ensure_assets(a.root, lm_steps=5, check_band=False, quiet=True) == a  # up to date: no rebuild
    assert read_manifest(a.root) == m


@pytest.mark.slow
def test_a_full_build_lands_in_its_band(tmp_path):
    """The default build (`python -m demos.calculator`) is published only inside its band. The folder
    comes from tests/build_cache.py's store when the build's sources and libraries are unchanged."""
    from build_cache import cached_build

    folder = cached_build("demos.calculator", tmp_path / "calculator_tiny", "--seed", "0", "--quiet")
    built = (folder / "manifest.json").stat().st_mtime_ns
    a = ensure_assets(folder, seed=0, quiet=True)
    assert (a.root / "manifest.json").stat().st_mtime_ns == built  # the CLI's defaults are the function's
    m = read_manifest(a.root)
    assert m["band_checked"] and m["band"] == BAND.describe()
    assert BAND.misses(m["metrics"]) == []
