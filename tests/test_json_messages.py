"""A prompt column of chat messages stored as JSON text (a CSV cell, a parquet string column, as many
exports write them) is read as those messages and rendered by the chat template exactly as the same
messages in a list column are, and counted; the same list written as Python's repr is refused naming the
file, the row, the field and the fix. Real parquet and CSV files, real chat templates (tests/chat_tokenizers.py)."""

from __future__ import annotations

import json

import pytest
from chat_tokenizers import QWEN25_DEFAULT_SYSTEM, QWEN25_SPECIALS, QWEN25_TEMPLATE, chat_tokenizer
from data_files import write_csv, write_parquet

from cluster.config.schema import ConfigError, DataSection
from cluster.prompts.loader import load_prompts

CHATS = [
    [{"role": "system", "content": "Answer in one word ."}, {"role": "user", "content": "What is 2 + 3 ?"}],
    [{"role": "user", "content": "Name a prime above 10 ."}],
]
WORDS = [m["content"] for c in CHATS for m in c] + [QWEN25_DEFAULT_SYSTEM, "system user assistant [1, 2]"]


def qwen():
    return chat_tokenizer(WORDS, QWEN25_SPECIALS, QWEN25_TEMPLATE, eos="<|im_end|>")


def section(path) -> DataSection:
    return DataSection(prompts_path=str(path), max_prompt_tokens=256)


def seen(prompts) -> list[tuple]:
    return [(p.index, p.text, p.ids.tolist(), p.messages) for p in prompts]


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_messages_written_as_json_text_are_rendered_as_the_list_column_is(tmp_path, fmt):
    tok = qwen()
    typed, typed_stats = load_prompts(
        section(write_parquet(tmp_path / "typed.parquet", [{"prompt": c, "answer": "5"} for c in CHATS])), tok
    )
    rows = [{"prompt": json.dumps(c), "answer": "5"} for c in CHATS]
    rows.append({"prompt": "[1, 2] sum ?", "answer": "3"})  # starts with '[' but is no messages: plain text
    writer = write_parquet if fmt == "parquet" else write_csv
    prompts, stats = load_prompts(section(writer(tmp_path / f"p.{fmt}", rows)), tok)
    assert seen(prompts[:2]) == seen(typed) and typed_stats.json_messages == 0
    assert "<|im_start|>user" in prompts[0].text and '"role"' not in prompts[0].text
    assert prompts[2].messages is None and prompts[2].text == "[1, 2] sum ?"
    assert stats.json_messages == 2 and prompts[0].meta == {"answer": "5"}
    assert stats.lines(section(tmp_path)) == [
        "read 2 string prompts (field 'prompt') as chat messages written as JSON text, rendered with the "
        "chat template"
    ]


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_messages_written_as_python_text_are_refused_naming_the_fix(tmp_path, fmt):
    rows = [{"prompt": "What is 2 + 3 ?", "answer": "5"}, {"prompt": str(CHATS[1]), "answer": "11"}]
    writer = write_parquet if fmt == "parquet" else write_csv
    path = writer(tmp_path / f"p.{fmt}", rows)
    with pytest.raises(
        ConfigError,
        match=rf"p.{fmt} row 1: field 'prompt' \(data.prompt_key\) holds chat messages written as Python text "
        r"\(single quotes, .*\), not JSON: write the column as JSON text \(json.dumps of each list\) or as a "
        r"list column",
    ):
        load_prompts(section(path), qwen())


def test_a_bad_message_in_json_text_names_the_row_and_how_it_was_read(tmp_path):
    bad = json.dumps([{"role": "bot", "content": "hi"}])
    path = write_csv(tmp_path / "p.csv", [{"prompt": "What is 2 + 3 ?"}, {"prompt": bad}])
    with pytest.raises(
        ConfigError,
        match=r"p.csv row 1: field 'prompt' \(data.prompt_key\): message 0 has role 'bot'; allowed: .* "
        r"\(the field is a string, read as JSON chat messages\)",
    ):
        load_prompts(section(path), qwen())


def test_a_csv_row_with_a_field_count_unlike_the_header_is_refused(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text('prompt,answer\n"What is 2 + 3 ?",5\nName a prime, above 10 .,11\n')
    with pytest.raises(
        ConfigError, match=r"p.csv row 1: 3 fields, but the header line has 2 \(prompt, answer\)"
    ):
        load_prompts(section(path), qwen())
