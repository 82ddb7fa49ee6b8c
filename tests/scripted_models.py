"""Tiny GPT-2 policies on the calculator demo's chat tokenizer (ChatML, Hermes tool calls; built here).

`scripted_policy(folder, script)`: a real GPT-2 whose next token is a function of the current token
only (a bigram table in its weights: one-hot embeddings, blocks that add nothing, an untied head that
maps each token to its successor with a margin of hundreds of nats), so it writes the same text every
time — e.g. a tool call — with logprobs of 0 to float precision. `random_policy(folder)`: an
untrained GPT-2 of the same vocabulary, for sampling with spread-out logprobs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from demos.calculator_corpus import chat_tokenizer

# After the generation prompt's newline the policy calls the calculator on 12*34 and ends its turn.
TOOL_CALL_SCRIPT = [
    "\n",
    "<tool_call>",
    '{"name": "',
    "calculator",
    '", "arguments": {"',
    "expression",
    '": "',
    "1",
    "2",
    "*",
    "3",
    "4",
    '"}}',
    "</tool_call>",
    "<|im_end|>",
]


def _config(tokenizer, n_embd: int) -> GPT2Config:
    return GPT2Config(
        vocab_size=len(tokenizer), n_positions=256, n_embd=n_embd, n_layer=1, n_head=1,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip


def scripted_policy(folder: Path, script: list[str] = TOOL_CALL_SCRIPT) -> tuple[str, object]:
    """A policy that, from each token of `script`, writes the next one (and from any other token, the
    script's second token)."""
    tok = chat_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in script]
    if len(set(ids[:-1])) != len(ids) - 1:
        raise ValueError("each token of the script may lead to one successor only")
    vocab = len(tok)
    model = GPT2LMHeadModel(_config(tok, vocab))
    with torch.no_grad():
        for p in model.transformer.h.parameters():
            p.zero_()  # the block adds nothing: attention and MLP project to 0
        model.transformer.wpe.weight.zero_()
        model.transformer.wte.weight.copy_(torch.eye(vocab))
        head = torch.zeros(vocab, vocab)
        successor = {a: b for a, b in zip(ids, ids[1:], strict=False)}
        for token in range(vocab):
            head[successor.get(token, ids[1]), token] = 100.0
        model.lm_head.weight.copy_(head)
    out = Path(folder)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out), tok


def random_policy(folder: Path, seed: int = 0) -> tuple[str, object]:
    tok = chat_tokenizer()
    torch.manual_seed(seed)
    GPT2LMHeadModel(_config(tok, 32)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder), tok
