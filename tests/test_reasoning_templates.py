"""Chat observations with the real templates of reasoning and strict-role models
(rollout_workers/chat_turns.py): DeepSeek-R1-Distill's, which removes the reasoning of every assistant
turn, and Qwen3's, which drops it before the last user message and closes an empty think block only in the
last assistant message, are refused, since the episodes trained on would keep what the served model
never sees; Gemma 3's, which refuses a `tool` message, is a
clear error naming the setting, raised by `cluster.train` before Ray starts."""

from __future__ import annotations

import pytest
import yaml
from chat_tokenizers import (
    DEEPSEEK_R1_DISTILL_TEMPLATE,
    DEEPSEEK_R1_SPECIALS,
    GEMMA3_SPECIALS,
    GEMMA3_TEMPLATE,
    QWEN3_SPECIALS,
    QWEN3_TEMPLATE,
    chat_tokenizer,
)

from rollout_workers.chat_turns import chat_observations

WORDS = ["be brief hello hi again observation what is two plus three <think> hmm </think> five # Tools"]


def deepseek():
    return chat_tokenizer(
        WORDS,
        DEEPSEEK_R1_SPECIALS,
        DEEPSEEK_R1_DISTILL_TEMPLATE,
        bos="<｜begin▁of▁sentence｜>",
        eos="<｜end▁of▁sentence｜>",
    )


def qwen3():
    return chat_tokenizer(WORDS, QWEN3_SPECIALS, QWEN3_TEMPLATE, eos="<|im_end|>")


def gemma3():
    return chat_tokenizer(WORDS, GEMMA3_SPECIALS, GEMMA3_TEMPLATE, bos="<bos>", eos="<end_of_turn>")


def stops(tok, *tokens: str) -> frozenset[int]:
    return frozenset(tok.convert_tokens_to_ids(t) for t in tokens)


def render(tok, messages, generation=True) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation, return_dict=True)
    return list(out["input_ids"])


@pytest.mark.parametrize("role", ["tool", "user"])
def test_deepseek_r1_distill_removing_past_reasoning_is_refused(role):
    tok = deepseek()
    with pytest.raises(
        ValueError,
        match=r"observation_format='chat': the chat template rewrites the content of an earlier assistant "
        r"turn: after \[user: hello / assistant: <think>\nhmm\n</think>\n\nhi\] and a '"
        + role
        + r"' message it does not write '<think>\\nhmm\\n</think>\\n\\nhi' as it is",
    ):
        chat_observations(tok, role, stops(tok, "<｜end▁of▁sentence｜>"))


@pytest.mark.parametrize("role", ["tool", "user"])
def test_qwen3_rewriting_past_assistant_turns_is_refused(role):
    """Qwen3 writes an empty think block only into the last assistant message (and drops the reasoning of
    turns before the last user message): an earlier turn's tokens change once a message follows it."""
    tok = qwen3()
    with pytest.raises(
        ValueError,
        match=rf"does not preserve the prefix: rendering a '{role}' message after \[user: hello / assistant: hi\]",
    ):
        chat_observations(tok, role, stops(tok, "<|im_end|>"))
    base = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}], tokenize=False
    )
    assert "<think>\n\n</think>\n\nhi" in base  # the real template's behaviour the refusal is about


def test_gemma3_refusing_a_tool_message_names_the_setting():
    tok = gemma3()
    with pytest.raises(
        ValueError,
        match=r"cannot render \[user: hello / assistant: hi / tool: observation\] \(TemplateError: "
        r"Conversation roles must alternate user/assistant/user/assistant/...\); set "
        r"rollout.environment.observation_role \(now 'tool'\) to a role the template takes",
    ):
        chat_observations(tok, "tool", stops(tok, "<end_of_turn>"))
    chat = chat_observations(tok, "user", stops(tok, "<end_of_turn>"))  # alternating roles: accepted
    assert chat.end_of_turn == tok.convert_tokens_to_ids("<end_of_turn>")


def test_train_refuses_the_template_before_ray_starts(tmp_path, capsys, monkeypatch):
    """`python -m cluster.train` exits 2 in its preflight with the worker's message and the setting,
    not with a Jinja error inside an actor's traceback."""
    from transformers import GPT2Config

    import cluster.train
    from cluster.train import main

    policy = tmp_path / "gemma"
    tok = gemma3()
    tok.save_pretrained(policy)
    GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(policy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [{"role": "user", "content": "what is two plus three"}]}\n')
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"policy_path": str(policy)},
                "data": {"prompts_path": str(prompts), "max_prompt_tokens": 64},
                "reward": {"kind": "environment"},
                "rollout": {
                    "environment": {"name": "tools", "max_total_tokens": 128, "observation_format": "chat"}
                },
            }
        )
    )
    started: list = []  # the run's own Ray start-up, watched (another test's Ray may be up in this process)
    monkeypatch.setattr(cluster.train, "init_ray", lambda cfg: started.append(cfg))
    assert main([str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "error: rollout.environment.observation_format='chat': the chat template cannot render" in err
    assert "Conversation roles must alternate" in err and "observation_role (now 'tool')" in err
    assert "model.policy_path=" in err and "Traceback" not in err
    assert started == [] and not (tmp_path / "run").exists()
