"""The calculator demo's offline build on the chat path: its tokenizer and ChatML template, the
conversations it pretrains on (the same ids an RL episode builds), its problem split and corpus mix, the
episode loop the build evaluates with (the run's own tools environment and observation renderer), its
band, and a real build from one seed (slow)."""

from __future__ import annotations

import random

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
    CHAT_TEMPLATE,
    DIRECT_CORRECT_FRAC,
    KINDS,
    N_EVAL,
    N_POSITIONS,
    N_RL,
    N_VAL,
    SHORT_PRODUCT_FRAC,
    TOOL_CALL_ID,
    TOOL_FRAC,
    chat_tokenizer,
    conversation,
    corpus,
    encode,
    episode_metrics,
    near_miss,
    problem,
    prompt_ids,
    run_episodes,
    split_problems,
    tool_call,
)
from demos.common import EOS_ID, PAD_ID, read_manifest
from rollout_workers.tools import parse_hermes_call


def test_role_markers_are_special_and_tool_call_pieces_ordinary_tokens():
    tok = chat_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (PAD_ID, EOS_ID, None)
    assert tok.convert_ids_to_tokens([PAD_ID, 1, EOS_ID]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert set(tok.all_special_ids) == {0, 1, 2}  # the tool-call tags stay in a decoded turn
    call = tok.encode(tool_call("37*48"), add_special_tokens=False)
    assert call[0] == TOOL_CALL_ID and len(call) == 13
    assert tok.convert_ids_to_tokens(call)[6:11] == ["3", "7", "*", "4", "8"]  # one token per digit
    text = tok.decode([*call, EOS_ID, PAD_ID], skip_special_tokens=True)
    assert text == tool_call("37*48") and parse_hermes_call(text, ["calculator"]).argument == "37*48"
    assert tok.encode("37*48=") == tok.encode("37*48=", add_special_tokens=False)  # no BOS anywhere


def test_the_template_renders_tool_calls_as_the_policy_writes_them():
    """A structured assistant tool call (OpenAI-style, as a user's data would hold it) renders to exactly
    the text the demo's policy writes, so conversations from either source tokenize alike."""
    tok = chat_tokenizer()
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*48"}}}
    structured = [
        {"role": "user", "content": "37*48="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "1776"},
    ]
    as_text = [structured[0], {"role": "assistant", "content": tool_call("37*48")}, structured[2]]
    rendered = tok.apply_chat_template(structured, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\n37*48=<|im_end|>\n<|im_start|>assistant\n" + tool_call("37*48") + "<|im_end|>\n"
        "<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.chat_template == CHAT_TEMPLATE


def test_encode_builds_the_templates_ids_and_marks_the_tool_messages():
    """Every kind of conversation: the ids built turn by turn (prompt, turns, observations rendered by
    the run's renderer) equal the template's render of the whole conversation up to its last
    <|im_end|>, and exactly the observation spans are the environment's."""
    tok = chat_tokenizer()
    rng = random.Random(0)
    for kind in KINDS:
        messages = conversation(rng, 37, 48, kind)
        (ids,), (env,) = encode(tok, [messages])
        full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert ids == full[: len(ids)] and full[len(ids) :] == tok.encode("\n"), kind
        assert ids[-1] == EOS_ID and len(ids) <= N_POSITIONS
        marked = tok.decode([t for t, m in zip(ids, env, strict=True) if m])
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        assert marked == "".join(f"\n<|im_start|>tool\n{v}<|im_end|>\n<|im_start|>assistant\n" for v in tools)
        assert ids[: len(prompt_ids(tok, "37*48="))] == prompt_ids(tok, "37*48=") and not any(env[:15])


def test_the_grouped_loss_is_the_loss_of_one_padded_batch():
    import torch
    from transformers import GPT2LMHeadModel

    from demos.calculator import grouped_lm_loss
    from demos.common import gpt2_config, pad

    tok = chat_tokenizer()
    ids, env = encode(tok, [m for _, m in corpus("t", split_problems(0)[1], 48)])
    assert {len(s) <= 24 for s in ids} == {True, False}  # both groups present
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(gpt2_config(len(tok), n_layer=2, n_embd=32, n_head=2, n_positions=N_POSITIONS))
    x, mask = pad(ids)
    by_env, _ = pad(env)
    one_batch = lm(
        input_ids=x, attention_mask=mask, labels=x.masked_fill((mask == 0) | (by_env == 1), -100)
    ).loss
    assert grouped_lm_loss(lm, ids, env).item() == pytest.approx(one_batch.item(), rel=1e-5)


def test_split_is_a_seeded_partition_of_all_problems():
    held_out, rl, pre_only = split_problems(0)
    assert (len(held_out), len(rl)) == (N_EVAL, N_RL) and len(pre_only) > N_VAL
    every = set(held_out) | set(rl) | set(pre_only)
    assert len(every) == len(held_out) + len(rl) + len(pre_only) == 90 * 90
    assert min(min(p) for p in every) == 10 and max(max(p) for p in every) == 99
    assert split_problems(0) == (held_out, rl, pre_only) and split_problems(1)[0] != held_out


def test_corpus_mix_and_every_conversation_is_consistent_with_the_calculator():
    held_out, rl, pre_only = split_problems(0)
    n = 20_000
    examples = corpus("0", rl + pre_only[N_VAL:], n)
    assert corpus("0", rl + pre_only[N_VAL:], 50) == examples[:50] and corpus("1", rl, 50) != examples[:50]
    counts = dict.fromkeys(KINDS, 0)
    direct_right = short = 0
    for kind, messages in examples:
        counts[kind] += 1
        a, b = (int(x) for x in messages[0]["content"][:-1].split("*"))
        assert (a, b) not in set(held_out) | set(pre_only[:N_VAL])  # neither held-out nor selection
        short += a * b < 1000
        turns = [m["content"] for m in messages[1:]]
        roles = [m["role"] for m in messages]
        if kind == "direct":
            assert roles == ["user", "assistant"]
            direct_right += int(turns[0]) == a * b
        elif kind == "no_close":
            assert roles == ["user", "assistant"] and "</tool_call>" not in turns[0]
            assert parse_hermes_call(turns[0], ["calculator"]).well_formed is False
        else:
            assert roles == ["user", "assistant", "tool", "assistant"]
            call = parse_hermes_call(turns[0], ["calculator"])
            x, y = (int(v) for v in call.argument.split("*"))
            assert int(turns[1]) == x * y  # a well-formed call is always answered by the calculator
            assert (call.argument == f"{a}*{b}") == (kind != "wrong_operand")
            assert (turns[2] == turns[1]) == (kind != "copy_error")
    share = {k: v / n for k, v in counts.items()}  # binomial sd <= 0.0035
    assert share["tool"] == pytest.approx(TOOL_FRAC, abs=0.015)
    for kind, s in BAD_KINDS.items():
        assert share[kind] == pytest.approx(BAD_TOOL_FRAC * s, abs=0.006)
    assert share["direct"] == pytest.approx(1 - TOOL_FRAC - BAD_TOOL_FRAC, abs=0.015)
    assert direct_right / counts["direct"] == pytest.approx(DIRECT_CORRECT_FRAC, abs=0.02)
    assert short / n == pytest.approx(SHORT_PRODUCT_FRAC, abs=0.015)


def test_near_miss_is_never_the_value():
    rng = random.Random(0)
    for value in [0, 1, 9, 100, 1776, 9801]:
        misses = {near_miss(rng, value) for _ in range(200)}
        assert value not in misses and min(misses) >= 0


def _stub_sampler(tok, script):
    """A hand-made policy: each stream's next turn is looked up by its problem and turn number (turns
    so far = the assistant headers in the stream, less one)."""

    def sample(streams):
        out = []
        for s in streams:
            text = tok.decode(s)
            question = text.split("user\n")[1].split("<|im_end|>")[0]
            turn, cut = script[question][text.count("<|im_start|>assistant") - 1]
            out.append(tok.encode(turn, add_special_tokens=False) + ([] if cut else [EOS_ID]))
        return out

    return sample


def test_run_episodes_puts_the_runs_environment_in_the_loop():
    tok = chat_tokenizer()
    call = tool_call
    script = {
        "37*48=": [(call("37*48"), False), ("1776", False)],  # the tool used right
        "12*10=": [("120", False)],  # a right direct answer
        "17*10=": [("12 170", False)],  # its last integer answers, as the environment reads it
        "11*11=": [("122", False)],  # a wrong one
        "13*13=": [(call("13*13")[:-15], False), ("169", False)],  # never closed: "error", then an answer
        "14*14=": [(call("14*14"), False)] * 3,  # calls until cut off by max_turns: unscored
        "15*15=": [(call("15*16"), False), ("240", False)],  # the wrong operand, faithfully copied
        "16*16=": [
            ('<tool_call>{"name": "calculator', True),
            ("256", False),
        ],  # cut by its length: <|im_end|> added
    }
    pairs = [tuple(int(x) for x in p[:-1].split("*")) for p in script]
    eps = run_episodes(_stub_sampler(tok, script), tok, pairs, max_turns=3)
    by = {e.pair: e for e in eps}
    tool = by[(37, 48)]
    assert tok.decode(tool.ids) == tok.apply_chat_template(
        [
            *problem(37, 48)["messages"],
            {"role": "assistant", "content": call("37*48")},
            {"role": "tool", "content": "1776"},
            {"role": "assistant", "content": "1776"},
        ],
        tokenize=False,
    ).removesuffix("\n")
    assert (tool.turns, tool.calls, tool.malformed, tool.correct) == ([call("37*48"), "1776"], 1, 0, True)
    assert by[(12, 10)].correct and by[(12, 10)].calls == 0 and not by[(11, 11)].correct
    assert by[(17, 10)].correct
    never_closed = by[(13, 13)]
    assert (never_closed.calls, never_closed.malformed, never_closed.correct) == (0, 1, True)
    assert "<|im_start|>tool\nerror<|im_end|>" in tok.decode(never_closed.ids)
    loop = by[(14, 14)]
    assert (len(loop.turns), loop.calls, loop.reward) == (3, 3, 0.0)
    assert tok.decode(loop.ids).count("<|im_start|>tool") == 2  # no observation after the last turn
    assert (
        by[(15, 15)].calls == 1 and not by[(15, 15)].correct and "tool\n240<" in tok.decode(by[(15, 15)].ids)
    )
    cut = by[(16, 16)]
    assert tok.decode(cut.ids).count("<|im_end|>") == 4 and cut.malformed == 1  # user, cut turn, tool, answer
    m = episode_metrics(eps)
    assert m == pytest.approx(
        {
            "accuracy": 5 / 8,
            "tool_call_rate": 3 / 8,
            "accuracy_given_call": 1 / 3,
            "malformed_call_rate": 2 / 8,
        }
    )


def test_hf_turns_end_at_a_stop_token_or_the_turn_limit():
    import torch
    from transformers import GPT2LMHeadModel

    from demos.common import gpt2_config

    tok = chat_tokenizer()
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(
        gpt2_config(len(tok), n_layer=1, n_embd=16, n_head=2, n_positions=N_POSITIONS)
    ).eval()
    with torch.no_grad():  # make <|im_end|> likely, so that turns of both kinds come out
        lm.lm_head.weight[EOS_ID] += 0.3
    streams = [
        prompt_ids(tok, "37*48="),
        encode(tok, [conversation(random.Random(0), 37, 48, "tool")])[0][0],
    ] * 20
    for greedy in (False, True):
        turns = hf_turns(lm, greedy=greedy, max_new_tokens=5)(streams)
        assert len(turns) == len(streams)
        for t in turns:
            assert 1 <= len(t) <= 5 and not set(t[:-1]) & set(STOP_IDS)
            assert t[-1] in STOP_IDS or len(t) == 5
    assert any(t[-1] == EOS_ID for t in hf_turns(lm, greedy=False, max_new_tokens=5)(streams))


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
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = ensure_assets(tmp_path / "calculator_tiny", lm_steps=5, check_band=False, quiet=True)
    assert isinstance(a, AssetPaths) and a.prompts.suffix == ".parquet"
    train, held = pq.read_table(a.prompts).to_pylist(), pq.read_table(a.eval_prompts).to_pylist()
    assert (len(train), len(held)) == (N_RL, N_EVAL)
    question = lambda r: r["messages"][0]["content"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in held}
    assert held[0].keys() == {"messages", "answer"} and held[0]["messages"][0]["role"] == "user"
    for r in held:
        x, y = question(r)[:-1].split("*")
        assert int(r["answer"]) == int(x) * int(y)
    lm = AutoModelForCausalLM.from_pretrained(a.policy, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(a.policy, local_files_only=True)
    assert lm.config.vocab_size == len(tok) == 32 and lm.config.n_positions == N_POSITIONS
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token_id == EOS_ID and tok.bos_token_id is None
    assert tok.encode(tool_call("37*48"), add_special_tokens=False) == chat_tokenizer().encode(
        tool_call("37*48")
    )
    assert lm.generation_config.eos_token_id == EOS_ID and lm.generation_config.bos_token_id is None
    m = read_manifest(a.root)
    assert m["lm_steps"] == 5 and (m["band_checked"], m["band"], m["selection"]["step"]) == (False, None, 5)
    assert m["tool_call_token_id"] == TOOL_CALL_ID
    assert 0.0 <= m["metrics"]["held_out_sampled_accuracy"] <= 1.0
    assert m["episode"]["eval_samples"] == EVAL_SAMPLES and m["episode"]["stop_token_ids"] == [EOS_ID]
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


def test_the_runs_logs_show_a_conversation_on_one_line_with_its_role_markers():
    from cluster.pipeline.evaluation import shown

    tok = chat_tokenizer()
    (ids,), _ = encode(tok, [conversation(random.Random(0), 37, 48, "tool")])
    line = shown(tok, [*ids, PAD_ID, PAD_ID])
    assert "\n" not in line and "<|endoftext|>" not in line
    assert line.startswith("<|im_start|>user\\n37*48=<|im_end|>\\n<|im_start|>assistant\\n<tool_call>")
    assert line.endswith("<|im_start|>tool\\n1776<|im_end|>\\n<|im_start|>assistant\\n1776<|im_end|>")
