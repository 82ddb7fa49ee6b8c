"""`python -m cluster.data CONFIG`: prints the prompts as the model sees them (special tokens visible),
their lengths, the dropped rows and the meta columns, and exits 0; on bad input it exits 2 with the
message naming the file, the row and the field. Run in-process through `main(argv)`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from chat_tokenizers import QWEN25_DEFAULT_SYSTEM, QWEN25_SPECIALS, QWEN25_TEMPLATE, chat_tokenizer
from data_files import write_jsonl, write_parquet

from cluster.data import main

QUESTIONS = ["What is 2 + 3 ?", "What is 4 + 4 ?", " ".join(["hello there"] * 60)]


def tokenizer_folder(tmp_path: Path, template: str | None = QWEN25_TEMPLATE) -> Path:
    words = [*QUESTIONS, QWEN25_DEFAULT_SYSTEM, "system user assistant"]
    folder = tmp_path / ("tok" if template else "tok_plain")
    chat_tokenizer(words, QWEN25_SPECIALS, template, eos="<|im_end|>").save_pretrained(folder)
    return folder


def config(
    tmp_path: Path, prompts: Path, data: dict | None = None, tok: Path | None = None, **sections
) -> Path:
    tree = {
        "model": {"policy_path": str(tok or tokenizer_folder(tmp_path))},
        "data": {
            "prompts_path": str(prompts),
            "max_prompt_tokens": 64,
            "meta_keys": ["answer"],
            **(data or {}),
        },
        "reward": {"kind": "rule", "rule": "exact_match"},
        **sections,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def chat_rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": q}], "answer": str(i)} for i, q in enumerate(QUESTIONS)]


def test_preview_prints_what_the_model_sees(tmp_path, capsys):
    prompts = write_parquet(tmp_path / "p.parquet", chat_rows())
    held_out = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "What is 4 + 4 ?", "answer": "8"}])
    cfg = config(tmp_path, prompts, {"wrap_string_prompts": True}, eval={"prompts_path": str(held_out)})
    assert main([str(cfg), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "=== training prompts" in out and "=== held-out prompts" in out
    assert "rows: 3, used 2" in out
    assert re.search(
        r"skipped 1 over data.max_prompt_tokens=64 \(the longest \d+ tokens.*, e.g. \S*p.parquet row 2\n", out
    )
    assert re.search(
        r"tokens: min \d+ / median [\d.]+ / p99 [\d.]+ / max \d+ \(data.max_prompt_tokens=64\)", out
    )
    assert "chat prompts: 2 of 2 (rendered with the tokenizer's chat template)" in out
    assert "answer: str (2 of 2 prompts)" in out
    # the first prompt, decoded with its special tokens; one per set with -n 1
    assert "<|im_start|> system You are Qwen," in out and "<|im_start|> assistant" in out
    assert out.count("--- prompt ") == 2 and '--- meta: {"answer": "0"}' in out


def test_preview_overrides_reach_the_config(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_rows())
    cfg = config(tmp_path, prompts)
    assert main([str(cfg), "--set", "data.max_prompt_tokens=500", "-n", "0"]) == 0
    out = capsys.readouterr().out
    assert "rows: 3, used 3" in out and "--- prompt" not in out


BAD = {
    "missing file": (lambda t: t / "nope.parquet", {}, r"data.prompts_path: file not found: .*nope.parquet"),
    "missing column": (
        lambda t: write_jsonl(t / "p.jsonl", [{"question": "hi", "answer": "1"}]),
        {},
        r"p.jsonl:1: missing field 'prompt' \(data.prompt_key\)",
    ),
    "bad role": (
        lambda t: write_parquet(
            t / "p.parquet", [{"prompt": [{"role": "bot", "content": "hi"}], "answer": "1"}]
        ),
        {},
        r"p.parquet row 0: field 'prompt' \(data.prompt_key\): message 0 has role 'bot'; allowed: system, user",
    ),
    "non-string prompt": (
        lambda t: write_jsonl(t / "p.jsonl", [{"prompt": "hi", "answer": "1"}, {"prompt": 5, "answer": "2"}]),
        {},
        r"p.jsonl:2: field 'prompt' \(data.prompt_key\) is a int",
    ),
    "messages with template none": (
        lambda t: write_jsonl(t / "p.jsonl", chat_rows()),
        {"chat_template": "none"},
        r"p.jsonl:1: field 'prompt': a list of chat messages, but data.chat_template='none'",
    ),
    "no meta key": (
        lambda t: write_jsonl(t / "p.jsonl", [{"prompt": "hi"}]),
        {},
        r"p.jsonl:1: missing field 'answer' \(listed in data.meta_keys\)",
    ),
    "unknown template kwarg": (
        lambda t: write_jsonl(t / "p.jsonl", chat_rows()),
        {"chat_template_kwargs": {"tokenize": False}},
        r"data.chat_template_kwargs: .*tokenize set by the data loader",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_preview_exits_2_naming_the_problem(tmp_path, capsys, case):
    make, data, message = BAD[case]
    assert main([str(config(tmp_path, make(tmp_path), data))]) == 2
    captured = capsys.readouterr()
    assert re.search(message, captured.err), captured.err
    assert captured.out == ""


def test_preview_refuses_chat_prompts_without_a_template(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", chat_rows())
    cfg = config(tmp_path, prompts, tok=tokenizer_folder(tmp_path, template=None))
    assert main([str(cfg)]) == 2
    assert re.search(
        r"p.jsonl:1: field 'prompt': a chat prompt, but the tokenizer \(model.tokenizer_path\) has no chat "
        r"template and data.chat_template='auto': set data.chat_template to a Jinja file",
        capsys.readouterr().err,
    )


def test_train_stops_on_bad_data_before_ray_starts(tmp_path, tiny_policy_dir, capsys, monkeypatch):
    """`cluster.train`'s preflight reads the prompts as the preview does: exit 2, no Ray, no actor.
    (`ray.init` is watched, not `ray.is_initialized()`: the session's own Ray may be up already.)"""
    import ray

    from cluster.train import main as train

    inits = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append((a, k)))

    bad = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "the film", "answer": "1"}, {"prompt": ["the film"], "answer": "2"}]
    )
    cfg = config(tmp_path, bad, tok=tiny_policy_dir)
    assert train([str(cfg)]) == 2
    assert "p.jsonl:2: field 'prompt' (data.prompt_key): message 0 is a str" in capsys.readouterr().err
    assert inits == []
