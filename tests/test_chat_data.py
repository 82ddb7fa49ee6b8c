"""Prompt data of a user's own chat model: every file format gives the same prompts, a messages prompt is
rendered by the chat template exactly as apply_chat_template renders it (never as Python text, BOS
once), over-long chat prompts are skipped and counted, and each bad row is a ConfigError naming the
file, the row and the field. No Ray, no model: word-level tokenizers with real chat templates."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from chat_tokenizers import (
    LLAMA3_SPECIALS,
    LLAMA3_TEMPLATE,
    QWEN25_DEFAULT_SYSTEM,
    QWEN25_SPECIALS,
    QWEN25_TEMPLATE,
    THINKING_TEMPLATE,
    chat_tokenizer,
)
from data_files import WRITERS, write, write_dataset, write_json, write_jsonl, write_parquet

from cluster.config.schema import ConfigError, DataSection, build_config
from cluster.prompts.loader import PromptStream, load_prompts, read_prompts
from cluster.reporting.folder import resolve_paths

QUESTIONS = ["What is 2 + 3 ?", "Name a prime above 10 .", "How many legs has a cat ?"]
ROWS = [
    {"prompt": [{"role": "user", "content": q}], "answer": a, "level": i, "tags": ["easy", str(i)]}
    for i, (q, a) in enumerate(zip(QUESTIONS, ["5", "11", "4"], strict=True))
]
SYSTEM = "Answer in one word ."
WORDS = [*QUESTIONS, SYSTEM, QWEN25_DEFAULT_SYSTEM, "system user assistant tool hello there <think> </think>"]


def qwen():
    return chat_tokenizer(WORDS, QWEN25_SPECIALS, QWEN25_TEMPLATE, eos="<|im_end|>")


def llama3():
    return chat_tokenizer(WORDS, LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>")


def reference_ids(tok, messages, **kwargs) -> list[int]:
    out = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True, **kwargs
    )
    return list(out["input_ids"])


def reference_text(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def section(path, **fields) -> DataSection:
    return DataSection(
        prompts_path=str(path) if isinstance(path, Path) else path, max_prompt_tokens=256, **fields
    )


def stream_of(prompts) -> list[tuple]:
    """Everything a run reads of its prompts, in the order the stream hands them out."""
    batch = PromptStream(prompts, seed=7, shuffle=True).next_batch(2 * len(prompts))
    return [(p.index, p.text, p.ids.tolist(), p.meta, p.messages) for p in batch]


def test_every_format_gives_the_same_prompt_stream(tmp_path):
    tok = qwen()
    streams = {}
    for fmt in WRITERS:
        prompts, stats = load_prompts(section(write(tmp_path, fmt, ROWS)), tok)
        assert stats.rows == 3 and len(prompts) == 3, fmt
        streams[fmt] = stream_of(prompts)
    assert all(s == streams["jsonl"] for s in streams.values())
    first = streams["jsonl"][0]
    assert {type(v) for v in first[3].values()} <= {str, int, list}  # plain Python, no numpy scalars
    assert [p for p in streams["jsonl"] if p[0] == 1][0][3] == {
        "answer": "11",
        "level": 1,
        "tags": ["easy", "1"],
    }


def test_several_files_and_globs_concatenate_with_stable_row_identities(tmp_path):
    tok = qwen()
    (tmp_path / "parts").mkdir()
    a = write_jsonl(tmp_path / "parts" / "a.jsonl", [{"prompt": "hello"}, {"prompt": "there"}])
    (tmp_path / "parts" / "a.jsonl").write_text(a.read_text() + "\n")  # a blank line: 3 lines
    write_parquet(tmp_path / "parts" / "b.parquet", [{"prompt": "hello there"}])
    ds = write_dataset(tmp_path / "c", [{"prompt": "there hello"}])
    cfg = section([str(tmp_path / "parts" / "*"), str(ds)], add_bos=False)
    prompts, _ = load_prompts(cfg, tok)
    # a.jsonl spans lines 0-2 (the blank one included), b.parquet row 0 is 3, the folder's row 0 is 4
    assert [(p.index, p.text) for p in prompts] == [
        (0, "hello"),
        (1, "there"),
        (3, "hello there"),
        (4, "there hello"),
    ]
    with pytest.raises(ConfigError, match=r"data.prompts_path: no file matches .*\*.parquet"):
        read_prompts(section(str(tmp_path / "*.parquet")))
    (tmp_path / "p.txt").write_text("prompt\nhi\n")
    with pytest.raises(
        ConfigError, match=r"p.txt: unknown format '.txt'; allowed: .jsonl, .json, .parquet, .csv"
    ):
        read_prompts(section(tmp_path / "p.txt"))


# ------------------------------------------------------------------ rendering


@pytest.mark.parametrize("system_prompt", [None, SYSTEM])
@pytest.mark.parametrize("row_system", [False, True])
def test_chatml_ids_are_apply_chat_templates(tmp_path, system_prompt, row_system):
    tok = qwen()
    own = [{"role": "system", "content": "hello there"}] if row_system else []
    rows = [{"prompt": [*own, {"role": "user", "content": q}]} for q in QUESTIONS]
    prompts, _ = load_prompts(section(write(tmp_path, "jsonl", rows), system_prompt=system_prompt), tok)
    for p, row in zip(prompts, rows, strict=True):
        # data.system_prompt goes first only where the row has no system message of its own
        expected = (
            row["prompt"]
            if row_system or system_prompt is None
            else [
                {"role": "system", "content": system_prompt},
                *row["prompt"],
            ]
        )
        assert p.messages == expected
        assert p.ids.tolist() == reference_ids(tok, expected)  # add_bos (default true) adds nothing
        assert p.text == reference_text(tok, expected)
        assert p.text.endswith("<|im_start|>assistant\n") and tok.unk_token_id not in p.ids
    default_system = system_prompt is None and not row_system
    assert (QWEN25_DEFAULT_SYSTEM in prompts[0].text) == default_system


@pytest.mark.parametrize("add_bos", [True, False])
def test_a_template_that_writes_the_bos_has_it_exactly_once(tmp_path, add_bos):
    tok = llama3()
    prompts, _ = load_prompts(
        section(write(tmp_path, "jsonl", ROWS), add_bos=add_bos, system_prompt=SYSTEM), tok
    )
    for p in prompts:
        assert p.ids.tolist() == reference_ids(tok, p.messages)
        assert p.ids[0] == tok.bos_token_id and int((p.ids == tok.bos_token_id).sum()) == 1
        assert p.text.startswith("<|begin_of_text|><|start_header_id|>system")
    twice = tmp_path / "twice.jinja"
    twice.write_text("{{ bos_token }}" + LLAMA3_TEMPLATE)
    with pytest.raises(
        ConfigError,
        match=r"prompts.jsonl:1: field 'prompt': the chat template .*twice.jinja"
        r" \(data.chat_template\) renders the BOS token twice",
    ):
        load_prompts(section(tmp_path / "prompts.jsonl", chat_template=str(twice)), tok)


def test_template_kwargs_reach_the_template(tmp_path):
    tok = chat_tokenizer(WORDS, QWEN25_SPECIALS, THINKING_TEMPLATE, eos="<|im_end|>")
    path = write(tmp_path, "jsonl", ROWS)
    plain, _ = load_prompts(section(path), tok)
    off, _ = load_prompts(section(path, chat_template_kwargs={"enable_thinking": False}), tok)
    for p, q in zip(plain, off, strict=True):
        assert not p.text.endswith("</think>\n\n") and q.text.endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        assert q.ids.tolist() == reference_ids(tok, q.messages, enable_thinking=False)
        assert len(q.ids) == len(p.ids) + 2
    with pytest.raises(
        ConfigError, match=r"data.chat_template_kwargs.*add_generation_prompt set by the data loader"
    ):
        build_config(
            {
                "model": {"policy_path": "p"},
                "data": {"prompts_path": "x", "chat_template_kwargs": {"add_generation_prompt": False}},
                "reward": {"model_path": "r"},
            }
        )


def test_a_jinja_file_replaces_the_tokenizers_template(tmp_path):
    tok = chat_tokenizer(WORDS, QWEN25_SPECIALS, None, eos="<|im_end|>")  # no template of its own
    path = write(tmp_path, "jsonl", ROWS)
    with pytest.raises(
        ConfigError,
        match=r"prompts.jsonl:1: field 'prompt': a chat prompt, but the tokenizer "
        r"\(model.tokenizer_path\) has no chat template and data.chat_template='auto'",
    ):
        load_prompts(section(path), tok)
    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(QWEN25_TEMPLATE)
    prompts, _ = load_prompts(section(path, chat_template=str(jinja)), tok)
    assert prompts[0].ids.tolist() == reference_ids(tok, prompts[0].messages, chat_template=QWEN25_TEMPLATE)
    with pytest.raises(ConfigError, match=r"data.chat_template: file not found: .*missing.jinja"):
        load_prompts(section(path, chat_template=str(tmp_path / "missing.jinja")), tok)
    # The folders a run writes (final/, cluster.export's) carry that template with the tokenizer.
    from transformers import AutoTokenizer

    from cluster.prompts.prompting import save_tokenizer

    tok.save_pretrained(tmp_path / "tok")
    assert save_tokenizer(section(path, chat_template=str(jinja)), str(tmp_path / "tok"), tmp_path / "out")
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert saved.chat_template == QWEN25_TEMPLATE
    assert reference_ids(saved, prompts[0].messages) == prompts[0].ids.tolist()


def test_wrapped_string_prompts_render_as_one_user_message(tmp_path):
    tok = qwen()
    path = write(tmp_path, "jsonl", [{"prompt": q} for q in QUESTIONS])
    plain, _ = load_prompts(section(path, add_bos=False), tok)
    assert [p.text for p in plain] == QUESTIONS and all(p.messages is None for p in plain)
    wrapped, _ = load_prompts(section(path, wrap_string_prompts=True), tok)
    for p, q in zip(wrapped, QUESTIONS, strict=True):
        assert p.messages == [{"role": "user", "content": q}]
        assert p.ids.tolist() == reference_ids(tok, p.messages) and p.text == reference_text(tok, p.messages)


def test_a_messages_column_never_reaches_the_model_as_python_text(tmp_path):
    tok = qwen()
    for fmt in WRITERS:
        prompts, _ = load_prompts(section(write(tmp_path, fmt, ROWS, name=f"m-{fmt}")), tok)
        for p in prompts:
            shown = tok.decode(p.ids.tolist(), skip_special_tokens=False)
            for text in (p.text, shown):
                assert not re.search(r"'role'|\"role\"|'content'|\[\{", text), (fmt, text)
            assert tok.unk_token_id not in p.ids  # every token is a word of the messages or the template


def test_null_optional_message_keys_are_absent_and_tool_calls_render(tmp_path):
    """A columnar file writes tool_calls: null for the messages without any: that is no tool call."""
    tok = qwen()
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    messages = [
        {"role": "user", "content": "What is 2 + 3 ?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5"},
        {"role": "user", "content": "hello there"},
    ]
    prompts, _ = load_prompts(section(write(tmp_path, "parquet", [{"prompt": messages}])), tok)
    assert prompts[0].messages == messages  # the nulls the parquet file holds are gone
    assert prompts[0].ids.tolist() == reference_ids(tok, messages)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompts[0].text


# ------------------------------------------------------------------ length


def test_over_long_chat_prompts_are_skipped_and_counted_never_cut(tmp_path):
    tok = qwen()
    long_q = " ".join(["hello there"] * 40)
    rows = [{"prompt": [{"role": "user", "content": q}]} for q in [QUESTIONS[0], long_q]] + [
        {"prompt": long_q}
    ]
    path = write(tmp_path, "jsonl", rows)
    short_len = len(reference_ids(tok, [{"role": "user", "content": QUESTIONS[0]}]))
    long_len = len(reference_ids(tok, [{"role": "user", "content": long_q}]))
    cfg = section(path, long_prompt="truncate", add_bos=False).model_copy(
        update={"max_prompt_tokens": short_len}
    )
    prompts, stats = load_prompts(cfg, tok)
    # the chat prompt is skipped whatever data.long_prompt says; the plain text one is still cut
    assert [p.index for p in prompts] == [0, 2] and (stats.skipped_long, stats.truncated) == (1, 1)
    assert stats.longest_skipped == long_len and len(prompts[1].ids) == short_len
    assert prompts[0].ids.tolist() == reference_ids(tok, [{"role": "user", "content": QUESTIONS[0]}])
    only_long = section(write(tmp_path, "jsonl", rows[1:2], name="long")).model_copy(
        update={"max_prompt_tokens": 20}
    )
    with pytest.raises(
        ConfigError,
        match=rf"no usable prompts \(0 empty, 1 over data.max_prompt_tokens=20, the longest {long_len}",
    ):
        load_prompts(only_long, tok)


# ------------------------------------------------------------------ bad input

BAD = {
    "missing column": (
        {"question": "hi"},
        {},
        r"missing field 'prompt' \(data.prompt_key\); the row has question",
    ),
    "number prompt": (
        {"prompt": 3},
        {},
        r"field 'prompt' \(data.prompt_key\) is a int; allowed: a string or a list",
    ),
    "object prompt": ({"prompt": {"role": "user"}}, {}, r"field 'prompt' \(data.prompt_key\) is a dict"),
    "bad role": (
        {"prompt": [{"role": "robot", "content": "hi"}]},
        {},
        r"field 'prompt' \(data.prompt_key\): message 0 has role 'robot'; allowed: system, user, assistant, tool",
    ),
    "no content": (
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "user"}]},
        {},
        r"field 'prompt' \(data.prompt_key\): message 1 \(user\) has no content; content must be a string",
    ),
    "number content": (
        {"prompt": [{"role": "user", "content": 7}]},
        {},
        r"message 0 \(user\) has a int content; content must be a string",
    ),
    "message not an object": (
        {"prompt": ["hi"]},
        {},
        r"message 0 is a str, not an object with role and content",
    ),
    "messages with template none": (
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"chat_template": "none"},
        r"field 'prompt': a list of chat messages, but data.chat_template='none' takes plain-text prompts only",
    ),
    "meta key missing": (
        {"prompt": "hi"},
        {"meta_keys": ["answer"]},
        r"missing field 'answer' \(listed in data.meta_keys\)",
    ),
}


MIXED_TYPES = {
    "number prompt",
    "object prompt",
    "message not an object",
    "number content",
}  # not in one parquet column


@pytest.mark.parametrize(
    ("case", "fmt"),
    [(c, "jsonl") for c in sorted(BAD)] + [(c, "parquet") for c in sorted(set(BAD) - MIXED_TYPES)],
)
def test_bad_rows_name_the_file_the_row_and_the_field(tmp_path, case, fmt):
    row, fields, message = BAD[case]
    good = {"prompt": "hello", "question": "x", "answer": "1"}
    rows = [good, row] if fmt == "jsonl" else [row]  # a parquet file's rows share their columns
    where = "prompts.jsonl:2" if fmt == "jsonl" else "prompts.parquet row 0"
    with pytest.raises(ConfigError, match=rf"{where}: .*{message}"):
        load_prompts(section(write(tmp_path, fmt, rows), **fields), qwen())


def test_meta_values_must_be_json_values(tmp_path):
    import datetime

    path = write(tmp_path, "parquet", [{"prompt": "hi", "when": datetime.date(2024, 1, 2)}])
    with pytest.raises(
        ConfigError, match=r"prompts.parquet row 0: field 'when' holds a date; meta values are JSON values"
    ):
        read_prompts(section(path))


def test_unreadable_files_name_themselves(tmp_path):
    (tmp_path / "obj.json").write_text('{"prompt": "hi"}')
    with pytest.raises(
        ConfigError, match=r"obj.json: a .json prompts file holds one list of objects, got a dict"
    ):
        read_prompts(section(tmp_path / "obj.json"))
    write_json(tmp_path / "l.json", [{"prompt": "hi"}, "hi"])
    with pytest.raises(ConfigError, match=r"l.json row 1: a row must be an object of columns, got a str"):
        read_prompts(section(tmp_path / "l.json"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"junk.parquet: not a readable parquet file"):
        read_prompts(section(tmp_path / "junk.parquet"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match=r"folder: a folder, but not one written by datasets' save_to_disk"):
        read_prompts(section(tmp_path / "folder"))
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"dd: a DatasetDict with splits train: name one split's folder"):
        read_prompts(section(tmp_path / "dd"))
    assert len(read_prompts(section(tmp_path / "dd" / "train"))) == 3


def test_chat_fields_without_a_template_are_refused():
    base = {"model": {"policy_path": "p"}, "reward": {"model_path": "r"}}
    for extra, name in (
        ({"system_prompt": "x"}, "system_prompt"),
        ({"wrap_string_prompts": True}, "wrap_string_prompts"),
    ):
        data = {"prompts_path": "x.jsonl", "chat_template": "none", **extra}
        with pytest.raises(
            ConfigError, match=rf"data.{name} apply to chat prompts, which data.chat_template='none'"
        ):
            build_config({**base, "data": data})


def test_paths_lists_and_template_files_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = {"model": {"policy_path": "p"}, "reward": {"model_path": "r"}}
    cfg = resolve_paths(
        build_config(
            {
                **base,
                "data": {"prompts_path": ["a.parquet", "d/*.jsonl"], "chat_template": "t.jinja"},
                "eval": {"prompts_path": ["e.json"]},
            }
        )
    )
    assert cfg.data.prompts_path == [str(tmp_path / "a.parquet"), str(tmp_path / "d/*.jsonl")]
    assert cfg.data.chat_template == str(tmp_path / "t.jinja") and cfg.eval.prompts_path == [
        str(tmp_path / "e.json")
    ]
    for keyword in ("auto", "none"):
        cfg = resolve_paths(
            build_config({**base, "data": {"prompts_path": "x.jsonl", "chat_template": keyword}})
        )
        assert cfg.data.chat_template == keyword


def test_plain_text_prompts_read_as_before(tmp_path):
    """A JSONL of strings: ids are BOS + the text's tokens, the row's other keys its meta."""
    tok = chat_tokenizer(["hello there"], [], None, bos="<s>")
    path = write(tmp_path, "jsonl", [{"prompt": "hello there", "answer": 3}])
    (prompt,), stats = load_prompts(section(path), tok)
    assert prompt.ids.tolist() == [tok.bos_token_id, *tok.convert_tokens_to_ids(["hello", "there"])]
    assert (prompt.text, prompt.meta, prompt.messages, stats.rows) == ("hello there", {"answer": 3}, None, 1)
    assert isinstance(prompt.ids, np.ndarray) and prompt.ids.dtype == np.int64
