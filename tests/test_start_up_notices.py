"""`python -m cluster.train` says, before step 1, what its data loading dropped: the over-long chat prompts
(every row with a long system message, on Qwen3's real template at the default data.max_prompt_tokens),
per file, training and held-out, with the longest length against the limit and what to set. Driven
through `cluster.train.main`, whose preflight reads the prompts; `--resume` of a folder without
checkpoints then stops it before Ray starts."""

from __future__ import annotations

import re

import yaml
from chat_tokenizers import QWEN3_SPECIALS, QWEN3_TEMPLATE, chat_tokenizer
from data_files import write_jsonl

SYSTEM = " ".join(["You are a careful assistant who answers in one word ."] * 8)  # 80 words
QUESTIONS = ["What is 2 + 3 ?", "Name a prime above 10 .", "How many legs has a cat ?", "What is 4 + 4 ?"]


def rows(system_every: int) -> list[dict]:
    out = []
    for i, q in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": q}]
        if i % system_every == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        out.append({"prompt": messages, "answer": str(i)})
    return out


def test_train_says_which_rows_it_skips_before_step_1(tmp_path, tiny_policy_dir, capsys, monkeypatch):
    import cluster.train
    from cluster.train import main

    tok = tmp_path / "qwen3"
    chat_tokenizer([SYSTEM, *QUESTIONS], QWEN3_SPECIALS, QWEN3_TEMPLATE, eos="<|im_end|>").save_pretrained(
        tok
    )
    train = write_jsonl(
        tmp_path / "train.jsonl", rows(system_every=2)
    )  # rows 0 and 2 have the system message
    held_out = write_jsonl(tmp_path / "eval.jsonl", rows(system_every=4))  # row 0 has it
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"policy_path": str(tiny_policy_dir), "tokenizer_path": str(tok)},
                "data": {"prompts_path": str(train)},  # data.max_prompt_tokens: the default, 64
                "eval": {"prompts_path": str(held_out), "max_prompts": 4},
                "reward": {"kind": "rule", "rule": "exact_match"},
            }
        )
    )
    started: list = []  # the run's own Ray start-up, watched (another test's Ray may be up in this process)
    monkeypatch.setattr(cluster.train, "init_ray", lambda cfg: started.append(cfg))
    assert main([str(config), "--resume", str(tmp_path / "no-run")]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    train_line = next(line for line in lines if "data.prompts_path" in line)
    assert re.fullmatch(
        rf"warning: data.prompts_path \({re.escape(str(train))}\): 4 rows, 2 prompts used: skipped 2 over "
        r"data.max_prompt_tokens=64 \(the longest (\d+) tokens; set data.max_prompt_tokens to \1 or more to "
        rf"keep them\), e.g. {re.escape(str(train))}:1; {re.escape(str(train))}:3",
        train_line,
    )
    longest = int(re.search(r"the longest (\d+) tokens", train_line).group(1))
    assert longest > 80  # the system message alone is 80 words
    eval_line = next(line for line in lines if "eval.prompts_path" in line)
    assert re.fullmatch(
        rf"warning: eval.prompts_path \({re.escape(str(held_out))}\): 4 rows, 3 prompts used: skipped 1 over "
        r"data.max_prompt_tokens=64 \(the longest (\d+) tokens; set data.max_prompt_tokens to \1 or more .*\), e.g."
        rf" {re.escape(str(held_out))}:1",
        eval_line,
    )
    # said by the preflight, before the run stops on --resume (and before Ray starts)
    assert lines.index(train_line) < lines.index(
        next(line for line in lines if line.startswith("error: --resume"))
    )
    assert started == []
