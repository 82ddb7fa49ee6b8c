"""The folders a run writes for serving (`final/`, `cluster.export`'s) carry how the run prompted its model:
`data.chat_template_kwargs` and `data.system_prompt` become the exported template's defaults (its
`apply_chat_template(messages)` with no kwargs renders what training rendered), and `prompting.json` /
`export.json` record them. A real run (Ray, DeepSpeed, a tiny GPT-2 whose tokenizer carries a ChatML
template with Qwen3's enable_thinking switch), then the real export of its checkpoint."""

from __future__ import annotations

import datetime
import json

import pytest
from chat_tokenizers import QWEN3_TEMPLATE, QWEN25_SPECIALS, THINKING_TEMPLATE, chat_tokenizer
from data_files import write_jsonl

from cluster.config.schema import DataSection, build_config
from cluster.prompts.prompting import PROMPTING_FILE, save_tokenizer

SYSTEM = "Answer in one word ."
QUESTIONS = ["What is 2 + 3 ?", "Name a prime above 10 .", "How many legs has a cat ?", "What is 4 + 4 ?"]
WORDS = [
    SYSTEM,
    *QUESTIONS,
    "<think> </think> system user assistant five eleven four eight hello be brief hi again",
]
KWARGS = {"enable_thinking": False}


def chat_policy(folder, template=THINKING_TEMPLATE):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = chat_tokenizer(WORDS, QWEN25_SPECIALS, template, eos="<|im_end|>")
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=1, n_head=2,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_tree(tmp_path, policy, prompts) -> dict:
    return {
        "run": {"name": "prompting", "output_dir": str(tmp_path), "steps": 1, "progress_bar": False, "loggers": ["jsonl"]},
        "model": {"policy_path": str(policy)},
        "data": {
            "prompts_path": str(prompts),
            "prompts_per_step": 4,
            "max_prompt_tokens": 64,
            "system_prompt": SYSTEM,
            "chat_template_kwargs": KWARGS,
        },
        "rollout": {"num_workers": 1, "num_cpus_per_worker": 0.5, "chunk_size": 4, "sampling": {"n": 1, "max_new_tokens": 2}},
        "reward": {"kind": "rule", "rule": "exact_match", "num_cpus": 0.25},
        "reference": {"num_cpus": 0.25},
        "cluster": {"placement": "colocated", "dashboard": False},
        "learner": {"num_ranks": 1, "num_cpus_per_rank": 1.0, "torch_threads": 1, "micro_batch_size": 4},
    }  # fmt: skip


def served_text(folder, messages) -> str:
    """What a server renders from the folder's tokenizer alone: no kwargs, no system prompt given."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_final_and_export_render_as_training_did_and_record_it(ray_local, tmp_path):
    from cluster.export import main as export_main
    from cluster.pipeline.checkpoint import list_checkpoints
    from cluster.pipeline.run import Run

    policy = chat_policy(tmp_path / "policy")
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": "five"} for q in QUESTIONS]
    cfg = build_config(run_tree(tmp_path, policy, write_jsonl(tmp_path / "p.jsonl", rows)))
    run_dir = tmp_path / "run"
    trainer = Run(cfg, run_dir)
    try:
        trainer.train()
        trained = {p.index: p.text for p in trainer.prompts}
    finally:
        trainer.close()
    assert SYSTEM in trained[0] and trained[0].endswith("<think>\n\n</think>\n\n")  # how training prompted
    out = tmp_path / "export"
    assert export_main([str(list_checkpoints(run_dir)[-1]), str(out), "--dtype", "float32"]) == 0
    want = {
        "chat_template": "the tokenizer's own",
        "chat_template_kwargs": KWARGS,
        "system_prompt": SYSTEM,
        "tools": [],
        "defaults_in_template": True,
        "note": "",
    }
    assert json.loads((out / "export.json").read_text())["prompting"] == want
    for folder in (run_dir / "final", out):
        assert json.loads((folder / PROMPTING_FILE).read_text()) == want, folder
        for i, q in enumerate(QUESTIONS):
            assert served_text(folder, rows[i]["prompt"]) == trained[i], (folder, q)
        # a caller's own system message and kwargs still win over the defaults
        own = [{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTIONS[0]}]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.apply_chat_template(
            own, tokenize=False, add_generation_prompt=True, enable_thinking=True
        ) == (
            tok.apply_chat_template(
                own, chat_template=THINKING_TEMPLATE, tokenize=False, add_generation_prompt=True
            )
        )


def test_the_real_qwen3_template_takes_the_defaults(tmp_path):
    """Qwen3's own template, prefixed with the defaults, renders a plain request as training did."""
    policy = tmp_path / "tok"
    chat_tokenizer(WORDS, QWEN25_SPECIALS, QWEN3_TEMPLATE, eos="<|im_end|>").save_pretrained(policy)
    data = DataSection(prompts_path="p.jsonl", system_prompt=SYSTEM, chat_template_kwargs=KWARGS)
    record = save_tokenizer(data, str(policy), tmp_path / "out")
    assert record.defaults_in_template and record.note == ""
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    from transformers import AutoTokenizer

    trained = AutoTokenizer.from_pretrained(policy).apply_chat_template(
        [{"role": "system", "content": SYSTEM}, *messages],
        tokenize=False,
        add_generation_prompt=True,
        **KWARGS,
    )
    assert served_text(tmp_path / "out", messages) == trained


def test_settings_the_template_cannot_take_are_recorded_with_the_reason(tmp_path):
    """A kwarg that is no JSON value cannot be written into the template: the template is saved as it is,
    and prompting.json records the settings and why they are not defaults."""
    policy = tmp_path / "tok"
    chat_tokenizer(WORDS, QWEN25_SPECIALS, THINKING_TEMPLATE, eos="<|im_end|>").save_pretrained(policy)
    kwargs = {"enable_thinking": False, "today": datetime.date(2026, 11, 28)}
    data = DataSection(prompts_path="p.jsonl", system_prompt=SYSTEM, chat_template_kwargs=kwargs)
    record = save_tokenizer(data, str(policy), tmp_path / "out")
    assert not record.defaults_in_template
    assert record.note == "a kwarg is not a JSON value (date is not a JSON value): pass them when serving"
    saved = json.loads((tmp_path / "out" / PROMPTING_FILE).read_text())
    assert saved["chat_template_kwargs"] == {"enable_thinking": False, "today": "2026-11-28"}
    assert saved["system_prompt"] == SYSTEM and not saved["defaults_in_template"]
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == THINKING_TEMPLATE
