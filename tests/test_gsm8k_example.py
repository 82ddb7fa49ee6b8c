"""The GPU example's data path, without a GPU: `prepare_gsm8k.py` turns GSM8K-shaped rows into chat
prompts, and the example config renders them exactly as apply_chat_template does with Qwen2.5's ChatML
template (a word-level tokenizer carrying it and Qwen's special tokens); the config validates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from chat_tokenizers import QWEN25_DEFAULT_SYSTEM, QWEN25_SPECIALS, QWEN25_TEMPLATE, chat_tokenizer
from data_files import write_jsonl, write_parquet

from cluster.config.schema import load_config
from cluster.data import main as preview
from cluster.prompts.loader import load_run_prompts, load_tokenizer

EXAMPLES = Path(__file__).resolve().parent.parent / "cluster" / "examples"
CONFIG = EXAMPLES / "qwen_gsm8k_gpu.yaml"
GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April , and then she sold half as many clips in May . "
        "How many clips did Natalia sell altogether in April and May ?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting . Yesterday , she just did 50 minutes of babysitting . "
        "How much did she earn ?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
        "$<<0.2*50=10>>10.\n#### 10",
    },
]


def prepare_module():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", EXAMPLES / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qwen_folder(tmp_path: Path, module) -> Path:
    """A save_pretrained tokenizer folder with Qwen2.5's template, knowing every word of the prompts."""
    words = [row["question"] for row in GSM8K] + [
        module.INSTRUCTION,
        QWEN25_DEFAULT_SYSTEM,
        "system user assistant",
    ]
    folder = tmp_path / "qwen"
    chat_tokenizer(words, QWEN25_SPECIALS, QWEN25_TEMPLATE, eos="<|im_end|>").save_pretrained(folder)
    return folder


def test_gsm8k_answers_and_questions_become_chat_prompts():
    module = prepare_module()
    assert module.final_answer("so 3 + 4 = 7.\n#### 7") == "7"
    assert module.final_answer("#### 1,234 ") == "1,234"  # exact_match's normalisation drops the comma
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        module.final_answer("the answer is 7")
    row = module.to_prompt(" What is 3 + 4 ? ", "#### 7")
    assert row == {
        "prompt": [{"role": "user", "content": f"What is 3 + 4 ?\n{module.INSTRUCTION}"}],
        "answer": "7",
    }
    assert "\\boxed{}" in module.INSTRUCTION


@pytest.mark.parametrize("source", ["parquet", "jsonl"])
def test_the_example_renders_its_prompts_with_qwens_template(tmp_path, source, capsys):
    module = prepare_module()
    raw = (write_parquet if source == "parquet" else write_jsonl)(tmp_path / f"train.{source}", GSM8K)
    out = tmp_path / "gsm8k_train.parquet"
    assert module.main([str(raw), str(out)]) == 0
    tok_dir = qwen_folder(tmp_path, module)
    overrides = [
        f"data.prompts_path={out}",
        f"eval.prompts_path={out}",
        f"model.policy_path={tok_dir}",
    ]
    cfg = load_config(CONFIG, overrides)
    tok = load_tokenizer(cfg)
    data = load_run_prompts(cfg, tok)
    assert len(data.train) == 2 and data.stats.skipped_long == 0 and len(data.eval) == 2
    for prompt, row in zip(data.train, GSM8K, strict=True):
        user = [{"role": "user", "content": f"{row['question']}\n{module.INSTRUCTION}"}]
        expected = tok.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert prompt.ids.tolist() == list(expected["input_ids"]) and tok.unk_token_id not in prompt.ids
        assert prompt.text == tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        assert prompt.text.startswith(
            f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n"
        )
        assert prompt.text.endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
        assert prompt.messages == user and prompt.meta == {"answer": row["answer"].rsplit("#### ", 1)[1]}
    capsys.readouterr()
    sets = [arg for o in overrides for arg in ("--set", o)]
    assert preview([str(CONFIG), *sets, "-n", "1"]) == 0
    shown = capsys.readouterr().out
    assert "<|im_start|> assistant" in shown and "answer: str (2 of 2 prompts)" in shown


def test_prepare_names_a_row_without_a_final_answer(tmp_path, capsys):
    module = prepare_module()
    raw = write_jsonl(tmp_path / "bad.jsonl", [GSM8K[0], {"question": "q", "answer": "no marker"}])
    assert module.main([str(raw), str(tmp_path / "out.parquet")]) == 2
    assert "bad.jsonl:2: answer has no '#### <number>' line" in capsys.readouterr().err


def test_the_example_config_validates_with_chat_prompts():
    cfg = load_config(CONFIG)
    data = cfg.data
    assert (
        data.prompts_path.endswith(".parquet")
        and data.chat_template == "auto"
        and data.prompt_key == "prompt"
    )
    assert data.meta_keys == ["answer"] and data.max_prompt_tokens >= 256 and data.system_prompt is None
    assert cfg.eval.prompts_path.endswith(".parquet") and cfg.reward.rule == "exact_match"
