"""Offline assets for the "positive movie reviews" demo: prompts, a tiny policy LM and a reward model.

Built from a seed on CPU in about a minute, so the demo and the end-to-end tests need no model hub.
The build writes into a temporary sibling folder and renames it into place at the end: a folder
with a `manifest.json` is always complete, and a second call with the same settings is a no-op.

    python -m cluster.demo_assets --out assets/sentiment_tiny [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.demo_corpus import BOS_ID, EOS_ID, PAD_ID, load_prompts, write_prompts

__all__ = ["AssetPaths", "ensure_assets", "load_prompts", "read_manifest", "main"]

FORMAT_VERSION = 1
N_REVIEWS = 20_000
N_VAL = 1_000
N_PROMPTS = 512
N_SAMPLES = 128
N_POSITIONS = 64
BUILD_THREADS = 2
LOCK_TIMEOUT_S = 900.0
# Plain temperature-1 sampling (top-k/top-p off), as the RL rollouts use.
_SAMPLING = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24)


@dataclass(frozen=True)
class AssetPaths:
    root: Path
    policy: Path
    reward: Path
    prompts: Path

    @classmethod
    def under(cls, root: Path) -> AssetPaths:
        return cls(root=root, policy=root / "policy", reward=root / "reward", prompts=root / "prompts.jsonl")


def read_manifest(root: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(root) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _is_current(root: Path, seed: int, lm_steps: int, clf_steps: int) -> bool:
    m = read_manifest(root)
    want = {"format_version": FORMAT_VERSION, "seed": seed, "lm_steps": lm_steps, "clf_steps": clf_steps}
    if m is None or any(m.get(k) != v for k, v in want.items()):
        return False
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
    if not force and _is_current(root, seed, lm_steps, clf_steps):
        return AssetPaths.under(root)
    _check_replaceable(root)
    log: Callable[[str], None] = (lambda _msg: None) if quiet else (lambda msg: print(msg, flush=True))
    root.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(root.parent / f".{root.name}.lock"):
        if not force and _is_current(root, seed, lm_steps, clf_steps):  # built by a concurrent caller
            return AssetPaths.under(root)
        for stale in [
            *root.parent.glob(f".{root.name}.building-*"),
            *root.parent.glob(f".{root.name}.old-*"),
        ]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed build; we hold the lock
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the published folder should read like any other
        try:
            manifest = _build(AssetPaths.under(tmp), seed, lm_steps, clf_steps, log)
            manifest.update(format_version=FORMAT_VERSION, versions=_versions())
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            _publish(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"assets ready in {root}")
    return AssetPaths.under(root)


def _check_replaceable(root: Path) -> None:
    """Refuse to overwrite a folder that is not ours (a typo in --out must not delete user data)."""
    if root.exists() and (not root.is_dir() or (any(root.iterdir()) and read_manifest(root) is None)):
        raise FileExistsError(
            f"{root} exists and is not a demo-assets folder (no manifest.json); remove it first"
        )


def _publish(tmp: Path, root: Path) -> None:
    old = None
    if root.exists():
        old = root.with_name(f".{root.name}.old-{os.getpid()}")
        os.replace(root, old)
    os.replace(tmp, root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Serialise builders of the same folder (e.g. `make train` and a test running together)."""
    with path.open("a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {path} for over {timeout_s:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- the build; torch and transformers are imported here so the up-to-date check stays instant ---


def _build(paths: AssetPaths, seed: int, lm_steps: int, clf_steps: int, log: Callable[[str], None]) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    prev = torch.get_num_threads(), hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(BUILD_THREADS)  # a fixed thread count makes the same seed give the same bytes
    hf_logging.set_verbosity_error()  # hides generate's harmless pad-after-EOS attention-mask warning
    hf_logging.disable_progress_bar()
    try:
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
            return _build_seeded(paths, seed, lm_steps, clf_steps, log)
    finally:
        torch.set_num_threads(prev[0])
        hf_logging.set_verbosity(prev[1])
        if prev[2]:
            hf_logging.enable_progress_bar()


def _build_seeded(
    paths: AssetPaths, seed: int, lm_steps: int, clf_steps: int, log: Callable[[str], None]
) -> dict:
    import torch
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    from cluster.demo_corpus import build_corpus, build_prompts, neutral_openings, train_tokenizer, vocabulary

    timings: dict[str, float] = {}
    t0 = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t0
        timings[name] = round(time.perf_counter() - t0, 2)
        log(f"[{name}] done in {timings[name]:.1f} s")
        t0 = time.perf_counter()

    corpus = build_corpus(seed, N_REVIEWS)
    prompts = build_prompts(seed, N_PROMPTS)
    write_prompts(paths.prompts, prompts)
    tokenizer = train_tokenizer([text for text, _ in corpus])
    ids = tokenizer([text for text, _ in corpus]).input_ids  # each starts with <bos>
    labels = [label for _, label in corpus]
    train_idx, val_idx = range(N_VAL, len(corpus)), range(N_VAL)
    sizes = {"reviews": len(corpus), "val_reviews": N_VAL, "distinct_words": len(vocabulary(corpus))}
    sizes.update(prompts=len(prompts), vocab_size=len(tokenizer))
    log(f"corpus and tokenizer: {sizes}")
    lap("corpus_tokenizer")

    torch.manual_seed(seed)
    lm = GPT2LMHeadModel(_gpt2_config(len(tokenizer), n_layer=4, n_embd=128, n_head=4))
    gen = lm.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = PAD_ID, BOS_ID, EOS_ID
    sizes["policy_params"] = _n_params(lm)
    log(f"policy LM: {sizes['policy_params']:,} parameters, {lm_steps} steps")

    def lm_loss(rows: list[int], _g: torch.Generator) -> torch.Tensor:
        input_ids, mask = _pad([ids[i] + [EOS_ID] for i in rows])
        return lm(
            input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100)
        ).loss

    _train(lm, lm_steps, 3e-3, train_idx, lm_loss, torch.Generator().manual_seed(seed), log, "lm")
    metrics = {"lm_val_loss": _lm_loss(lm, [ids[i] + [EOS_ID] for i in val_idx])}
    lap("lm_train")

    torch.manual_seed(seed + 1)
    clf_cfg = _gpt2_config(len(tokenizer), n_layer=2, n_embd=64, n_head=4)
    clf_cfg.num_labels, clf_cfg.problem_type = 2, "single_label_classification"
    clf_cfg.id2label, clf_cfg.label2id = {0: "negative", 1: "positive"}, {"negative": 0, "positive": 1}
    clf = GPT2ForSequenceClassification(clf_cfg)
    sizes["reward_params"] = _n_params(clf)
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
        input_ids, mask = _pad([x + [EOS_ID] * e for x, e in zip(seqs, eos, strict=True)])
        target = torch.tensor([0.5 if n else float(labels[i]) for i, n in zip(rows, is_neutral, strict=True)])
        logp = clf(input_ids=input_ids, attention_mask=mask).logits.log_softmax(-1)
        return -(target * logp[:, 1] + (1 - target) * logp[:, 0]).mean()

    _train(clf, clf_steps, 2e-3, train_idx, clf_loss, torch.Generator().manual_seed(seed + 1), log, "clf")
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
        "timings_s": timings,
        "samples": [{"text": s, "p_positive": round(p, 4)} for s, p in zip(samples, p_pos, strict=True)][:8],
    }


def _gpt2_config(vocab_size: int, n_layer: int, n_embd: int, n_head: int) -> Any:
    from transformers import GPT2Config

    # Dropout 0 everywhere: RL needs deterministic forwards, and GPT-2 dropout consumes the global RNG.
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    ids = dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    size = dict(vocab_size=vocab_size, n_positions=N_POSITIONS, n_embd=n_embd, n_layer=n_layer, n_head=n_head)
    return GPT2Config(**size, **no_dropout, **ids)


def _n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def _pad(seqs: list[list[int]]) -> tuple[Any, Any]:
    import torch

    ids = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def _train(
    model: Any, steps: int, lr: float, rows: range, loss_of: Callable, g: Any, log: Callable, name: str
) -> None:
    """AdamW, short linear warm-up then cosine decay, batch 64 drawn as seeded epoch permutations."""
    import math

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    order: list[int] = []
    model.train()
    for step in range(steps):
        if len(order) < 64:
            order += [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        batch, order = order[:64], order[64:]
        loss = loss_of(batch, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  {name} step {step + 1}/{steps} loss {loss.item():.3f}")
    model.eval()


def _lm_loss(lm: Any, seqs: list[list[int]]) -> float:
    """Mean next-token loss per predicted token (pads excluded)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(seqs), 250):
            ids, mask = _pad(seqs[i : i + 250])
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


def _versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    mods = {"torch": torch, "transformers": transformers, "tokenizers": tokenizers}
    return {"python": platform.python_version(), **{k: m.__version__ for k, m in mods.items()}}


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
    parser = argparse.ArgumentParser(prog="python -m cluster.demo_assets", description=__doc__.split("\n")[0])
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
