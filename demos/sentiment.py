"""Offline assets of the "positive movie reviews" demo: prompts, a tiny policy LM and a reward model.

Built from a seed on CPU in about a minute, so the demo and the end-to-end tests need no model hub.
Alongside the training prompts, `eval_prompts.jsonl` holds openings the run never trains on (the
held-out set of the `eval:` config section). See `demos.common` for how a build is published.

    python -m demos.sentiment --out assets/sentiment_tiny [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demos.common import (
    BOS_ID,
    BUILD_THREADS,
    EOS_ID,
    PAD_ID,
    Laps,
    Log,
    ensure_built,
    file_lock,
    gpt2_config,
    load_prompts,
    logger,
    n_params,
    pad,
    quiet_deterministic_torch,
    read_manifest,
    set_generation_ids,
    train_loop,
    write_jsonl,
)
from demos.sentiment_corpus import build_eval_prompts, write_prompts

__all__ = ["AssetPaths", "ensure_assets", "load_prompts", "read_manifest", "main"]

FORMAT_VERSION = 1
N_REVIEWS = 20_000
N_VAL = 1_000
N_PROMPTS = 512
N_EVAL_PROMPTS = 64
N_SAMPLES = 128
N_POSITIONS = 64
# Plain temperature-1 sampling (top-k/top-p off), as the RL rollouts use.
_SAMPLING = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24)


@dataclass(frozen=True)
class AssetPaths:
    root: Path
    policy: Path
    reward: Path
    prompts: Path
    eval_prompts: Path

    @classmethod
    def under(cls, root: Path) -> AssetPaths:
        return cls(
            root=root,
            policy=root / "policy",
            reward=root / "reward",
            prompts=root / "prompts.jsonl",
            eval_prompts=root / "eval_prompts.jsonl",
        )


def _is_complete(root: Path) -> bool:
    paths = AssetPaths.under(root)
    return paths.policy.is_dir() and paths.reward.is_dir() and paths.prompts.is_file()


def ensure_assets(
    out_dir: str | Path,
    seed: int = 0,
    *,
    lm_steps: int = 600,
    clf_steps: int = 150,
    quiet: bool = False,
    force: bool = False,
) -> AssetPaths:
    """Build the demo assets into `out_dir` unless a complete build with these settings is there."""
    root = Path(out_dir).resolve()
    if lm_steps < 1 or clf_steps < 1:
        raise ValueError(f"lm_steps and clf_steps must be >= 1, got {lm_steps} and {clf_steps}")
    want = {"format_version": FORMAT_VERSION, "seed": seed, "lm_steps": lm_steps, "clf_steps": clf_steps}

    def build(tmp: Path, log: Log) -> dict:
        with quiet_deterministic_torch():
            return _build_seeded(AssetPaths.under(tmp), seed, lm_steps, clf_steps, log)

    ensure_built(root, want, _is_complete, build, logger(quiet), force)
    paths = AssetPaths.under(root)
    if not paths.eval_prompts.is_file():  # a folder built before held-out prompts existed: add them
        with file_lock(root.parent / f".{root.name}.lock"):
            _write_eval_prompts(paths, seed)
    return paths


def _write_eval_prompts(paths: AssetPaths, seed: int) -> None:
    """Openings drawn from their own seeded stream, none equal to a training prompt."""
    held_out = build_eval_prompts(seed, N_EVAL_PROMPTS, exclude=set(load_prompts(paths.prompts)))
    write_jsonl(paths.eval_prompts, [{"prompt": p} for p in held_out])


# --- the build; torch and transformers are imported here so the up-to-date check stays instant ---


def _build_seeded(paths: AssetPaths, seed: int, lm_steps: int, clf_steps: int, log: Log) -> dict:
    import torch
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    from demos.sentiment_corpus import (
        build_corpus,
        build_prompts,
        neutral_openings,
        train_tokenizer,
        vocabulary,
    )

    lap = Laps(log)

    corpus = build_corpus(seed, N_REVIEWS)
    prompts = build_prompts(seed, N_PROMPTS)
    write_prompts(paths.prompts, prompts)
    _write_eval_prompts(paths, seed)
    tokenizer = train_tokenizer([text for text, _ in corpus])
    ids = tokenizer([text for text, _ in corpus]).input_ids  # each starts with <bos>
    labels = [label for _, label in corpus]
    train_idx, val_idx = range(N_VAL, len(corpus)), range(N_VAL)
    sizes = {"reviews": len(corpus), "val_reviews": N_VAL, "distinct_words": len(vocabulary(corpus))}
    sizes.update(prompts=len(prompts), vocab_size=len(tokenizer))
    log(f"corpus and tokenizer: {sizes}")
    lap("corpus_tokenizer")

    torch.manual_seed(seed)
    lm = GPT2LMHeadModel(gpt2_config(len(tokenizer), n_layer=4, n_embd=128, n_head=4))
    set_generation_ids(lm)
    sizes["policy_params"] = n_params(lm)
    log(f"policy LM: {sizes['policy_params']:,} parameters, {lm_steps} steps")

    def lm_loss(rows: list[int], _g: torch.Generator) -> torch.Tensor:
        input_ids, mask = pad([ids[i] + [EOS_ID] for i in rows])
        return lm(
            input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100)
        ).loss

    train_loop(lm, lm_steps, 3e-3, train_idx, lm_loss, torch.Generator().manual_seed(seed), log, "lm")
    metrics = {"lm_val_loss": _lm_loss(lm, [ids[i] + [EOS_ID] for i in val_idx])}
    lap("lm_train")

    torch.manual_seed(seed + 1)
    clf_cfg = gpt2_config(len(tokenizer), n_layer=2, n_embd=64, n_head=4)
    clf_cfg.num_labels, clf_cfg.problem_type = 2, "single_label_classification"
    clf_cfg.id2label, clf_cfg.label2id = {0: "negative", 1: "positive"}, {"negative": 0, "positive": 1}
    clf = GPT2ForSequenceClassification(clf_cfg)
    sizes["reward_params"] = n_params(clf)
    log(f"reward classifier: {sizes['reward_params']:,} parameters, {clf_steps} steps")
    neutral = tokenizer(neutral_openings(seed, 4000)).input_ids

    def clf_loss(rows: list[int], g: torch.Generator) -> torch.Tensor:
        # A fifth of the rows are neutral openings with target P(positive) = 0.5 (the corpus's true rate),
        # so a truncated or empty response scores neutral instead of an arbitrary confident value.
        # Half the rows end in <eos>, so scoring token ids that keep the policy's EOS works as well as text.
        is_neutral = (torch.rand(len(rows), generator=g) < 0.2).tolist()
        pick = torch.randint(len(neutral), (len(rows),), generator=g).tolist()
        eos = (torch.rand(len(rows), generator=g) < 0.5).tolist()
        seqs = [neutral[k] if n else ids[i] for i, n, k in zip(rows, is_neutral, pick, strict=True)]
        input_ids, mask = pad([x + [EOS_ID] * e for x, e in zip(seqs, eos, strict=True)])
        target = torch.tensor([0.5 if n else float(labels[i]) for i, n in zip(rows, is_neutral, strict=True)])
        logp = clf(input_ids=input_ids, attention_mask=mask).logits.log_softmax(-1)
        return -(target * logp[:, 1] + (1 - target) * logp[:, 0]).mean()

    train_loop(clf, clf_steps, 2e-3, train_idx, clf_loss, torch.Generator().manual_seed(seed + 1), log, "clf")
    val_texts, val_labels = [corpus[i][0] for i in val_idx], [labels[i] for i in val_idx]
    metrics["clf_val_accuracy"] = _accuracy(clf, tokenizer, val_texts, val_labels)
    metrics["clf_val_accuracy_with_eos"] = _accuracy(
        clf, tokenizer, [x + "<eos>" for x in val_texts], val_labels
    )
    on_prompts = _p_positive(clf, tokenizer, prompts)  # neutral text: want 0.5
    metrics["clf_prompt_mean_p_positive"] = float(on_prompts.mean())
    metrics["clf_prompt_mean_abs_dev"] = float((on_prompts - 0.5).abs().mean())
    lap("clf_train")

    torch.manual_seed(seed + 2)
    samples, metrics["sample_eos_fraction"] = _sample(lm, tokenizer, prompts[:N_SAMPLES])
    p_pos = _p_positive(clf, tokenizer, samples).tolist()
    metrics["sample_mean_p_positive"] = sum(p_pos) / len(p_pos)
    metrics = {k: round(v, 4) for k, v in metrics.items()} | {"samples_scored": len(samples)}
    log(f"metrics: {metrics}")
    lap("sample_score")

    for model, folder in ((lm, paths.policy), (clf, paths.reward)):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    lap("save")
    return {
        "seed": seed,
        "lm_steps": lm_steps,
        "clf_steps": clf_steps,
        "build_threads": BUILD_THREADS,
        "special_token_ids": {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID},
        "sizes": sizes,
        "metrics": metrics,
        "timings_s": lap.timings,
        "samples": [{"text": s, "p_positive": round(p, 4)} for s, p in zip(samples, p_pos, strict=True)][:8],
    }


def _lm_loss(lm: Any, seqs: list[list[int]]) -> float:
    """Mean next-token loss per predicted token (pads excluded)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(seqs), 250):
            ids, mask = pad(seqs[i : i + 250])
            logits = lm(input_ids=ids, attention_mask=mask).logits[:, :-1]
            target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            total += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="sum"))
            count += int((target != -100).sum())
    return total / count


def _p_positive(clf: Any, tokenizer: Any, texts: list[str]) -> Any:
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 250):
            enc = tokenizer(texts[i : i + 250], padding=True, return_tensors="pt")
            out.append(clf(**enc).logits.softmax(-1)[:, 1])
    return torch.cat(out)


def _accuracy(clf: Any, tokenizer: Any, texts: list[str], labels: list[int]) -> float:
    predicted = (_p_positive(clf, tokenizer, texts) > 0.5).long().tolist()
    return sum(p == y for p, y in zip(predicted, labels, strict=True)) / len(labels)


def _sample(lm: Any, tokenizer: Any, prompts: list[str]) -> tuple[list[str], float]:
    """Plain temperature-1 samples; prompts grouped by length so no padding is needed."""
    import torch

    by_len: dict[int, list[int]] = {}
    encoded = tokenizer(prompts).input_ids
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    texts: list[str] = [""] * len(prompts)
    n_eos = 0
    with torch.no_grad():
        for length, rows in sorted(by_len.items()):
            ids = torch.tensor([encoded[i] for i in rows])
            out = lm.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
                **_SAMPLING,
            )
            n_eos += int((out[:, length:] == EOS_ID).any(dim=1).sum())
            for i, seq in zip(rows, out.tolist(), strict=True):
                texts[i] = tokenizer.decode(seq, skip_special_tokens=True)
    return texts, n_eos / len(prompts)


def _summary(paths: AssetPaths, elapsed: float) -> str:
    m = read_manifest(paths.root) or {}
    lines = [
        f"assets: {paths.root} (seed {m.get('seed')}, format {m.get('format_version')}, {elapsed:.1f} s)"
    ]
    for section in ("timings_s", "sizes", "metrics"):
        items = ", ".join(f"{k}={v}" for k, v in (m.get(section) or {}).items())
        lines.append(f"  {section}: {items}")
    lines.append("  samples (P(positive) | prompt + response):")
    lines += [f"    {s['p_positive']:.3f} | {s['text']}" for s in m.get("samples", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demos.sentiment", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to build into, e.g. assets/sentiment_tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-steps", type=int, default=600)
    parser.add_argument("--clf-steps", type=int, default=150)
    parser.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build is there")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    kw = dict(lm_steps=args.lm_steps, clf_steps=args.clf_steps, quiet=args.quiet, force=args.force)
    paths = ensure_assets(args.out, args.seed, **kw)
    print(_summary(paths, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
