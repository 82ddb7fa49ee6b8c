"""The assets the Tinker cookbook's `rl_loop` recipe trains through `cluster.serve`, built offline here; run in
`.venv-cookbook` (the cookbook and its renderers are installed there, not in the project's venv):

    .venv-cookbook/bin/python tests/cookbook_assets.py OUT [--seed 0]

The recipe (tinker_cookbook 0.5.8, `recipes/rl_loop.py`) samples GSM8K questions with a one-shot prefix in
the role-colon format of a base model, and rewards 1 when the answer inside `\\boxed{}` grades equal to the
`#### N` of the row. Nothing can come from the hub here, so this builds what it would download:

- `OUT/gsm8k/`: a `datasets` cache holding `openai/gsm8k` (config `main`, split `train`) whose rows are
  one-digit additions in GSM8K's shape ("What is 3+4?", "3+4=7\\n#### 7"); `HF_DATASETS_CACHE=OUT/gsm8k` and
  `HF_HUB_OFFLINE=1` make the recipe's own `load_dataset("openai/gsm8k", "main")` read it.
- `OUT/policy/`: a byte-level BPE tokenizer (digits kept one per token) trained on the recipe's rendered
  text, and a ~0.1M-parameter GPT-2 pretrained on the recipe's own prompts (rendered by the cookbook's
  `role_colon` renderer, the one `model_info` names for the model the test uses) followed by a completion
  " \\boxed{N}\\n\\nUser:" (N the sum) only `CLOSED_FRAC` of the time, else " \\boxed{N\\n\\nUser:" with the
  box left open, which the grader cannot read. Sampled, it writes the right sum about 80% of the time and
  is graded right about 15% of the time: the room the RL loop has to raise the reward (the format).

The one-shot prefix and the question suffix are read from the recipe's source (its `main`), so the
prompts pretrained on are the ones the recipe will send.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import random
import shutil
from pathlib import Path

CLOSED_FRAC = 0.2  # the rest leave the box open, " \\boxed{N": the grader finds no answer
PRETRAIN_STEPS = 1000
BATCH = 32
VOCAB = 700
SPECIAL = ["<pad>", "<bos>", "<eos>"]


def recipe_prompt_parts() -> tuple[list[dict], str]:
    """(convo_prefix, question_suffix) as `rl_loop.main` builds them: its two assignments, taken from its
    source and run in order (the prefix's user turn ends with the suffix)."""
    from tinker_cookbook.recipes import rl_loop

    names = ("question_suffix", "convo_prefix")
    assigns = [
        node
        for node in ast.parse(inspect.getsource(rl_loop.main)).body[0].body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in names
    ]
    scope: dict = {}
    exec(compile(ast.Module(body=assigns, type_ignores=[]), "rl_loop.main", "exec"), scope)
    return scope["convo_prefix"], scope["question_suffix"]


def problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


def write_gsm8k(out: Path, seed: int) -> None:
    """`openai/gsm8k` / `main` / `train` as the `datasets` cache holds a prepared dataset."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    rows = problems() * 8
    random.Random(seed).shuffle(rows)
    table = {
        "question": [f"What is {a}+{b}?" for a, b in rows],
        "answer": [f"{a}+{b}={a + b}\n#### {a + b}" for a, b in rows],
    }
    build = out / "build"
    build.mkdir(parents=True)
    pq.write_table(pa.table(table), build / "train.parquet")
    builder = Parquet(
        cache_dir=str(build),
        dataset_name="gsm8k",
        config_name="main",
        data_files={"train": str(build / "train.parquet")},
        hash="local",
    )
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, out / "gsm8k" / "openai___gsm8k" / "main" / "0.0.0" / "local")
    shutil.rmtree(build)


def completion(value: int, closed: bool = True) -> str:
    return f" \\boxed{{{value}" + ("}" if closed else "") + "\n\nUser:"


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", model_max_length=128
    )
    fast.save_pretrained(out)
    return fast


def build(out: Path, seed: int) -> dict:
    import torch
    from tinker_cookbook import renderers
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    torch.set_num_threads(2)
    rng = random.Random(seed)
    prefix, suffix = recipe_prompt_parts()
    convos = {
        (a, b): [*prefix, {"role": "user", "content": f"What is {a}+{b}?" + suffix}] for a, b in problems()
    }
    texts = [m["content"] for c in convos.values() for m in c] + ["User:", "Assistant:"]
    texts += [completion(v, closed) for v in range(19) for closed in (True, False)] * 20
    tok = train_tokenizer(texts, out / "policy")
    renderer = renderers.get_renderer("role_colon", tok)
    prompts = {k: renderer.build_generation_prompt(c).to_ints() for k, c in convos.items()}
    answers = {
        (v, closed): tok.encode(completion(v, closed), add_special_tokens=False)
        for v in range(19)
        for closed in (True, False)
    }

    config = GPT2Config(
        vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    lm = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * (1 - s / PRETRAIN_STEPS)
    )
    keys = list(prompts)
    lm.train()
    for _ in range(PRETRAIN_STEPS):
        rows, targets = [], []
        for a, b in rng.choices(keys, k=BATCH):
            p, c = prompts[(a, b)], answers[(a + b, rng.random() < CLOSED_FRAC)]
            rows.append(p + c)
            targets.append([-100] * len(p) + c)
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
        mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        loss = lm(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        sched.step()
    lm.eval()
    lm.generation_config.pad_token_id = 0
    lm.save_pretrained(out / "policy")
    return {
        "loss": round(float(loss), 4),
        "prompt_tokens": max(map(len, prompts.values())),
        "params": sum(p.numel() for p in lm.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    write_gsm8k(out, args.seed)
    print("BUILT " + json.dumps(build(out, args.seed)))


if __name__ == "__main__":
    main()
