"""Offline assets of the "tiny model learns to add" demo: a verifiable (rule) reward, no reward model.

The task is two-digit addition written as text: the prompt "12+35=", the answer "47". A character
tokenizer (digits, '+', '=', and <pad>/<bos>/<eos>) and a ~0.4M-parameter GPT-2 are built from a seed.
The policy is pretrained on a corpus where only `correct_frac` of the worked examples carry the right
sum; the others carry a near miss (off by 1, 2, 10 or 11, or with two digits swapped). It so learns
addition but answers correctly only some of the time when sampled: the room RL with the rule reward
`exact_integer` has to improve it.

The 10,000 problems (a, b in 0..99) are split once, by the seed: the held-out problems
(`eval_prompts.jsonl`) are never in the pretraining corpus nor in the RL prompts (`prompts.jsonl`), and
N_VAL selection problems are in neither the corpus nor the files.

The pretraining is made to land in the same place whatever the CPU's floating-point details (a
different machine gives different weights from the same seed): AdamW under transformers' warm-up +
cosine schedule for enough steps to converge, and the weights kept are those with the best greedy
accuracy on the selection problems among checkpoints of the run's second half. The result is then
checked against `BAND` on the held-out problems (greedy accuracy high: it can add; sampled accuracy
well below: RL has room); a build that misses it raises BuildQualityError and publishes nothing.

    python -m demos.arithmetic --out assets/arithmetic_tiny [--seed 0] [--force] [--no-band]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demos import BuildQualityError
from demos.common import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Laps,
    Log,
    bos_tokenizer,
    ensure_built,
    gpt2_config,
    logger,
    n_params,
    pad,
    pretrain_selected,
    quiet_deterministic_torch,
    report_build,
    set_generation_ids,
    warmup_cosine,
    write_jsonl,
)
from demos.common import RuleDemoPaths as AssetPaths  # the folder layout every rule demo has
from demos.common import near_miss as common_near_miss

FORMAT_VERSION = 2
MAX_OPERAND = 99
N_EVAL = 256
N_RL = 2048
N_VAL = 256  # selection problems, carved from the pretraining-only ones and left out of the corpus
CORRECT_FRAC = 0.4
BUILD_THREADS = 1  # the model is small: one thread is as fast, and steadier on a busy machine
LM_STEPS = 2000
LM_BATCH = 128
LM_LR = 2e-3
LM_WARMUP_FRAC = 0.05
LM_MIN_LR_RATE = 0.05
LM_SELECT_EVERY = 100
N_POSITIONS = 16
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
ALPHABET = list("0123456789+=")


def ensure_assets(
    out_dir: str | Path,
    seed: int = 0,
    *,
    lm_steps: int = LM_STEPS,
    correct_frac: float = CORRECT_FRAC,
    check_band: bool = True,
    quiet: bool = False,
    force: bool = False,
) -> AssetPaths:
    """Build the arithmetic demo into `out_dir` unless a complete build with these settings is there.
    With `check_band` a build whose policy misses `BAND` raises BuildQualityError and publishes nothing."""
    if lm_steps < 1 or not 0.0 < correct_frac <= 1.0:
        raise ValueError(f"lm_steps must be >= 1 and correct_frac in (0, 1], got {lm_steps}, {correct_frac}")
    root = Path(out_dir).resolve()
    want = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "lm_steps": lm_steps,
        "correct_frac": correct_frac,
        "band_checked": check_band,
    }

    def build(tmp: Path, log: Log) -> dict:
        with quiet_deterministic_torch(BUILD_THREADS):
            return _build(
                AssetPaths.under(tmp), seed, lm_steps, correct_frac, BAND if check_band else None, log
            )

    ensure_built(root, want, AssetPaths.complete, build, logger(quiet), force)
    return AssetPaths.under(root)


# --- the task ---


def problem(a: int, b: int) -> dict[str, Any]:
    """One prompt row: the text the policy continues and the answer the rule reward checks."""
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def split_problems(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """(held-out, RL, pretraining-only) problems: a seeded partition of all a+b with a, b <= MAX_OPERAND.
    Pretraining sees RL and pretraining-only problems; nothing sees the held-out ones."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(f"arith-split-{seed}").shuffle(pairs)
    return pairs[:N_EVAL], pairs[N_EVAL : N_EVAL + N_RL], pairs[N_EVAL + N_RL :]


def near_miss(rng: random.Random, total: int) -> int:
    """A plausible wrong sum: off by 1, 2, 10 or 11 either way, or two digits swapped; never `total`."""
    return common_near_miss(rng, total, (-11, -10, -2, -1, 1, 2, 10, 11))


def corpus(seed: int, pairs: list[tuple[int, int]], correct_frac: float, n: int) -> list[str]:
    """`n` worked examples "a+b=c" over `pairs`; a `correct_frac` share of them with the right c."""
    rng = random.Random(f"arith-corpus-{seed}")
    out = []
    for _ in range(n):
        a, b = rng.choice(pairs)
        c = a + b if rng.random() < correct_frac else near_miss(rng, a + b)
        out.append(f"{a}+{b}={c}")
    return out


def char_tokenizer() -> Any:
    """One token per character, <bos> prepended, decoded without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return bos_tokenizer(tok, N_POSITIONS)


# --- the build ---


def _build(
    paths: AssetPaths, seed: int, lm_steps: int, correct_frac: float, band: Band | None, log: Log
) -> dict:
    import torch
    from transformers import GPT2LMHeadModel

    lap = Laps(log)
    held_out, rl, pre_only = split_problems(seed)
    val, pre_train = pre_only[:N_VAL], pre_only[N_VAL:]  # selection problems: in no corpus example
    write_jsonl(paths.prompts, [problem(a, b) for a, b in rl])
    write_jsonl(paths.eval_prompts, [problem(a, b) for a, b in held_out])
    texts = corpus(seed, rl + pre_train, correct_frac, LM_BATCH * lm_steps)
    tokenizer = char_tokenizer()
    ids = [x + [EOS_ID] for x in tokenizer(texts).input_ids]
    lap("corpus_tokenizer")

    torch.manual_seed(seed)
    lm = GPT2LMHeadModel(gpt2_config(len(tokenizer), n_layer=3, n_embd=96, n_head=4, n_positions=N_POSITIONS))
    set_generation_ids(lm)
    sizes = {
        "problems_held_out": len(held_out),
        "problems_rl": len(rl),
        "problems_pretrain_only": len(pre_train),
        "problems_selection": len(val),
    }
    sizes.update(vocab_size=len(tokenizer), policy_params=n_params(lm), corpus_examples=len(texts))
    log(f"arithmetic policy: {sizes['policy_params']:,} parameters, {lm_steps} steps, sizes {sizes}")

    def lm_loss(rows: list[int]) -> Any:
        input_ids, mask = pad([ids[i] for i in rows])
        return lm(
            input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100)
        ).loss

    curve = pretrain(
        lm, lm_steps, len(ids), lm_loss, lambda: accuracy(lm, tokenizer, val, greedy=True), seed, log
    )
    lap("lm_train")

    torch.manual_seed(seed + 2)
    metrics = {
        "held_out_sampled_accuracy": accuracy(lm, tokenizer, held_out, greedy=False),
        "held_out_greedy_accuracy": accuracy(lm, tokenizer, held_out, greedy=True),
        "selection_greedy_accuracy": curve["selected_accuracy"],
    }
    log(f"metrics: {metrics}")
    lap("evaluate")
    if band is not None:
        band.check(metrics, seed, lm_steps)
    lm.save_pretrained(paths.policy)
    tokenizer.save_pretrained(paths.policy)
    lap("save")
    return {
        "build_threads": BUILD_THREADS,
        "special_token_ids": {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID},
        "sizes": sizes,
        "metrics": {k: round(v, 4) for k, v in metrics.items()},
        "band": None if band is None else band.describe(),
        "selection": {"step": curve["selected_step"], "greedy_accuracy_by_step": curve["accuracy_by_step"]},
        "timings_s": lap.timings,
    }


def lr_schedule(opt: Any, steps: int) -> Any:
    """transformers' linear warm-up (LM_WARMUP_FRAC of the steps) then cosine decay to LM_MIN_LR_RATE x lr."""
    return warmup_cosine(opt, steps, LM_WARMUP_FRAC, LM_MIN_LR_RATE)


def pretrain(
    lm: Any,
    steps: int,
    n_rows: int,
    loss_of: Callable,
    select_metric: Callable[[], float],
    seed: int,
    log: Log,
    select_every: int = LM_SELECT_EVERY,
) -> dict:
    """`demos.common.pretrain_selected` with this demo's settings: the weights with the best
    `select_metric` (held-out greedy accuracy on the selection problems) are kept (ties: the later)."""
    curve = pretrain_selected(
        lm,
        steps,
        n_rows,
        loss_of,
        select_metric,
        seed,
        log,
        batch=LM_BATCH,
        lr=LM_LR,
        schedule=lr_schedule,
        select_every=select_every,
        higher_is_better=True,
        what="selection greedy accuracy",
        log_every=250,
    )
    return {
        "selected_step": curve["selected_step"],
        "selected_accuracy": curve["selected_score"],
        "accuracy_by_step": curve["score_by_step"],
    }


@dataclass(frozen=True)
class Band:
    """The quality a build must reach on the held-out problems: greedy accuracy (has it learned to add?)
    at least `greedy_min`, and sampled accuracy within [sampled_min, sampled_max] (well below greedy:
    the room RL has)."""

    greedy_min: float = 0.85
    sampled_min: float = 0.15
    sampled_max: float = 0.6

    def describe(self) -> dict[str, float]:
        return {
            "greedy_min": self.greedy_min,
            "sampled_min": self.sampled_min,
            "sampled_max": self.sampled_max,
        }

    def misses(self, metrics: dict[str, float]) -> list[str]:
        greedy, sampled = metrics["held_out_greedy_accuracy"], metrics["held_out_sampled_accuracy"]
        out = []
        if greedy < self.greedy_min:
            out.append(f"held-out greedy accuracy {greedy:.3f} < {self.greedy_min}")
        if not self.sampled_min <= sampled <= self.sampled_max:
            out.append(
                f"held-out sampled accuracy {sampled:.3f} outside [{self.sampled_min}, {self.sampled_max}]"
            )
        return out

    def check(self, metrics: dict[str, float], seed: int, lm_steps: int) -> None:
        misses = self.misses(metrics)
        if misses:
            raise BuildQualityError(
                f"arithmetic build (seed {seed}, {lm_steps} pretraining steps) missed its quality band "
                f"(held-out greedy accuracy >= {self.greedy_min}, sampled accuracy in "
                f"[{self.sampled_min}, {self.sampled_max}]): {'; '.join(misses)}. Nothing was published. "
                "Try more steps (--lm-steps) or report it with the manifest's versions."
            )


BAND = Band()


def accuracy(lm: Any, tokenizer: Any, pairs: list[tuple[int, int]], greedy: bool) -> float:
    """Share of `pairs` answered exactly (temperature-1 samples, or greedy), prompts grouped by length."""
    import torch

    by_len: dict[int, list[tuple[int, int]]] = {}
    for a, b in pairs:
        by_len.setdefault(len(f"{a}+{b}="), []).append((a, b))
    right = 0
    with torch.no_grad():
        for group in by_len.values():
            ids = torch.tensor(tokenizer([problem(a, b)["prompt"] for a, b in group]).input_ids)
            out = lm.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=not greedy,
                temperature=1.0 if not greedy else None,
                top_k=0 if not greedy else None,
                top_p=1.0 if not greedy else None,
                max_new_tokens=4,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
            )
            answers = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
            right += sum(ans == str(a + b) for ans, (a, b) in zip(answers, group, strict=True))
    return right / len(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demos.arithmetic", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to build into, e.g. assets/arithmetic_tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-steps", type=int, default=LM_STEPS)
    parser.add_argument("--correct-frac", type=float, default=CORRECT_FRAC)
    parser.add_argument("--no-band", action="store_true", help="publish even if the policy misses the band")
    parser.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build is there")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    kw = dict(lm_steps=args.lm_steps, correct_frac=args.correct_frac, quiet=args.quiet, force=args.force)
    return report_build(lambda: ensure_assets(args.out, args.seed, check_band=not args.no_band, **kw))


if __name__ == "__main__":
    sys.exit(main())
