"""Tiny random models and a word-level tokenizer for unit tests (built in well under a second)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast

WORDS = [
    "the",
    "movie",
    "film",
    "was",
    "is",
    "great",
    "terrible",
    "good",
    "bad",
    "fun",
    "boring",
    "i",
    "loved",
    "hated",
    "it",
    "and",
    "but",
    "a",
    "plot",
    "acting",
    "story",
    "very",
    "not",
    ".",
]
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def _config(tokenizer, n_layer: int, n_embd: int, n_head: int = 2) -> GPT2Config:
    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_policy(out: Path, seed: int = 0, n_embd: int = 32) -> Path:
    """A 2-layer GPT-2 with 2 heads (head_dim n_embd/2; vLLM's CPU attention needs >= 32: n_embd=64)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(_config(tokenizer, n_layer=2, n_embd=n_embd))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_classifier(out: Path, seed: int = 1) -> Path:
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    cfg = _config(tokenizer, n_layer=1, n_embd=16)
    cfg.num_labels = 2
    model = GPT2ForSequenceClassification(cfg)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# Per-family config fields of tiny causal LMs (vocab and special ids from the word-level tokenizer).
# Each family differs where the learner once diverged from transformers' own forward: GQA and tied
# embeddings (Qwen2), a final logit softcap (Gemma2), a logit divisor (Granite), a logit multiplier
# (Cohere). A larger init std than HF's 0.02 makes the logits peaked, so a missed scaling shows.
FAMILIES: dict[str, dict] = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
    "llama": {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    "qwen2": {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "gemma2": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "final_logit_softcapping": 2.0,
        "attn_logit_softcapping": 5.0,
        "sliding_window": 4,
        "query_pre_attn_scalar": 8,
    },
    "granite": {"num_attention_heads": 4, "num_key_value_heads": 2, "logits_scaling": 4.0},
    "cohere": {"num_attention_heads": 4, "num_key_value_heads": 2, "logit_scale": 0.25},
    # Mixtures of experts (docs/moe.md): 4 experts, top-2, in every layer. transformers 5.24 keeps the
    # experts fused (3-D `gate_up_proj` / `down_proj` of one `*Experts` module) beside a `*TopKRouter`
    # `gate`; Qwen3-MoE renormalises the top-2 weights only with norm_topk_prob, Mixtral always.
    "qwen3_moe": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
    },
    "mixtral": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def build_causal_lm(out: Path, family: str, seed: int = 0, **fields) -> Path:
    """A 2-layer causal LM of `family` (a key of FAMILIES) with the word-level tokenizer, saved to `out`;
    `fields` override config fields (e.g. hidden_size=128 for head_dim 32, what vLLM's CPU attention needs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    common = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "initializer_range": 0.3,
    }
    if family != "gpt2":
        common.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64)
    config = AutoConfig.for_model(family, **{**common, **FAMILIES[family], **fields})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


JUDGE_WORDS = [
    "<|user|>",
    "<|assistant|>",
    "Yes",
    "No",
    "Question:",
    "Response:",
    "Reference",
    "answer:",
    "Is",
    "the",
    "response",
    "correct?",
    "Answer",
    "or",
    "No.",
    "score:",
    *"0123456789",
]
# One user message, then the assistant's turn: a chat template of the judge's own.
JUDGE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def build_judge(out: Path, seed: int = 2, reply: str | None = None, n_embd: int = 16) -> Path:
    """A 1-layer GPT-2 judge with a word-level tokenizer of its own and a chat template (n_embd=64 for
    vLLM, whose CPU attention needs a head size of at least 32). `reply`: every
    position's logits put the token `reply` far ahead (final layer norm to a constant vector, an untied
    lm_head with one row along it), so greedy generation repeats it: a judge whose answer is known."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + JUDGE_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = JUDGE_CHAT_TEMPLATE
    cfg = _config(tokenizer, n_layer=1, n_embd=n_embd)
    cfg.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    if reply is not None:
        with torch.no_grad():
            direction = torch.ones(cfg.n_embd)
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.copy_(direction)
            model.lm_head.weight.zero_()
            model.lm_head.weight[vocab[reply]] = 10.0 * direction / cfg.n_embd
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
