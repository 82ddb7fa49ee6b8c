"""Offline assets of the "tiny chat model learns to use a calculator" demo: a multi-turn tool-use task
on the chat path (ChatML role tokens, Hermes-style JSON tool calls, tool messages), with the
environment's verifiable reward.

The task is two-digit multiplication, "37*48=" -> "1776", which a ~1M-parameter model cannot do in its
head. It can call a calculator instead, over several turns (demos/calculator_corpus.py has the task and
an episode as the chat template renders it):

    user            37*48=
    assistant       <tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>
    tool            1776
    assistant       1776

The prompts are parquet files of chat messages (`messages`, plus the `answer` column the environment
checks), rendered by the tokenizer's chat template; the policy was pretrained on conversations
rendered by the same template. A word-level tokenizer (the ChatML specials, role names, the tool-call
tags and JSON pieces as single tokens, one token per digit) and a 0.8M-parameter GPT-2 are built from a
seed. The policy is pretrained on conversations that use the tool right only `tool_frac` of the time,
badly (mostly a call never closed; a wrong operand; a result copied wrong) `bad_frac` of the time, and
otherwise answer directly, mostly wrong (a near miss). It so knows how to use the tool but seldom does:
RL with the environment's reward has to teach it to.

The 8,100 problems (a, b in 10..99) are split once, by the seed: the held-out problems
(`eval_prompts.parquet`) are never in the corpus nor in the RL prompts (`prompts.parquet`), and N_VAL
selection problems are in neither the corpus nor the files. AdamW under transformers' warm-up + cosine
schedule; the weights kept are those with the lowest LM loss on selection conversations among
checkpoints of the run's second half. The result is checked against `BAND` by playing episodes on the
held-out problems here with the run's own `tools` environment and observation renderer in the loop
(`run_episodes`); a build that misses it raises BuildQualityError and publishes nothing.

    python -m demos.calculator --out assets/calculator_tiny [--seed 0] [--force] [--no-band]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from demos import BuildQualityError
from demos.calculator_corpus import (
    BAD_KINDS,
    BAD_TOOL_FRAC,
    DIRECT_CORRECT_FRAC,
    MAX_TURNS,
    N_POSITIONS,
    N_VAL,
    SHORT_PRODUCT_FRAC,
    TOOL_CALL_ID,
    TOOL_FRAC,
    TurnSampler,
    chat_tokenizer,
    corpus,
    encode,
    episode_metrics,
    problem,
    run_episodes,
    split_problems,
)
from demos.common import (
    EOS_ID,
    PAD_ID,
    Laps,
    Log,
    RuleDemoPaths,
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
    write_parquet,
)


@dataclass(frozen=True)
class AssetPaths(RuleDemoPaths):
    """The rule demos' folder layout, with the prompts as parquet files of chat messages."""

    @classmethod
    def under(cls, root: Path) -> AssetPaths:
        return cls(root, root / "policy", root / "prompts.parquet", root / "eval_prompts.parquet")


FORMAT_VERSION = 2  # 2: the chat path (ChatML, Hermes tool calls, parquet prompts)
BUILD_THREADS = 1  # the model is small: one thread is as fast, and steadier on a busy machine
LM_STEPS = 1200
LM_BATCH = 64
LM_LR = 2e-3
LM_WARMUP_FRAC = 0.05
LM_MIN_LR_RATE = 0.05
LM_SELECT_EVERY = 100
N_SELECT_EXAMPLES = 1024  # selection transcripts (of the corpus's mix) over the selection problems
TURN_MAX_TOKENS = 20  # a call is 14 tokens with its <|im_end|>, an answer at most 5
EVAL_SAMPLES = 8  # sampled episodes per held-out problem
SHORT_ROW = 24  # pretraining rows up to this many tokens (direct answers) are padded apart from the rest
STOP_IDS = (EOS_ID,)  # a policy turn ends at <|im_end|>


def ensure_assets(
    out_dir: str | Path,
    seed: int = 0,
    *,
    lm_steps: int = LM_STEPS,
    tool_frac: float = TOOL_FRAC,
    bad_frac: float = BAD_TOOL_FRAC,
    check_band: bool = True,
    quiet: bool = False,
    force: bool = False,
) -> AssetPaths:
    """Build the calculator demo into `out_dir` unless a complete build with these settings is there.
    With `check_band` a build whose policy misses `BAND` raises BuildQualityError and publishes nothing."""
    if lm_steps < 1 or not (tool_frac > 0.0 and bad_frac >= 0.0 and tool_frac + bad_frac <= 1.0):
        raise ValueError(f"need lm_steps >= 1, tool_frac > 0, tool_frac + bad_frac <= 1: {locals()}")
    root = Path(out_dir).resolve()
    want = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "lm_steps": lm_steps,
        "tool_frac": tool_frac,
        "bad_frac": bad_frac,
        "band_checked": check_band,
    }

    def build(tmp: Path, log: Log) -> dict:
        with quiet_deterministic_torch(BUILD_THREADS):
            band = BAND if check_band else None
            return _build(AssetPaths.under(tmp), seed, lm_steps, tool_frac, bad_frac, band, log)

    ensure_built(root, want, AssetPaths.complete, build, logger(quiet), force)
    return AssetPaths.under(root)


# --- the build ---


def _build(
    paths: AssetPaths,
    seed: int,
    lm_steps: int,
    tool_frac: float,
    bad_frac: float,
    band: Band | None,
    log: Log,
) -> dict:
    import torch
    from transformers import GPT2LMHeadModel

    lap = Laps(log)
    held_out, rl, pre_only = split_problems(seed)
    val, pre_train = pre_only[:N_VAL], pre_only[N_VAL:]  # selection problems: in no corpus example
    write_parquet(paths.prompts, [problem(a, b) for a, b in rl])
    write_parquet(paths.eval_prompts, [problem(a, b) for a, b in held_out])
    examples = corpus(str(seed), rl + pre_train, LM_BATCH * lm_steps, tool_frac, bad_frac)
    select_examples = corpus(f"select-{seed}", val, N_SELECT_EXAMPLES, tool_frac, bad_frac)
    tokenizer = chat_tokenizer()
    ids, env = encode(tokenizer, [t for _, t in examples])
    sel_ids, sel_env = encode(tokenizer, [t for _, t in select_examples])
    lap("corpus_tokenizer")

    torch.manual_seed(seed)
    lm = GPT2LMHeadModel(
        gpt2_config(len(tokenizer), n_layer=4, n_embd=128, n_head=4, n_positions=N_POSITIONS)
    )
    set_generation_ids(lm, bos_id=None)  # no BOS: the chat template opens every message
    sizes = {
        "problems_held_out": len(held_out),
        "problems_rl": len(rl),
        "problems_pretrain_only": len(pre_train),
        "problems_selection": len(val),
    }
    sizes.update(vocab_size=len(tokenizer), policy_params=n_params(lm), corpus_examples=len(examples))
    log(f"calculator policy: {sizes['policy_params']:,} parameters, {lm_steps} steps, sizes {sizes}")

    def lm_loss(rows: list[int], seqs: list[list[int]] = ids, masks: list[list[int]] = env) -> Any:
        return grouped_lm_loss(lm, [seqs[i] for i in rows], [masks[i] for i in rows])

    def selection_loss() -> float:
        with torch.no_grad():
            return lm_loss(list(range(len(sel_ids))), sel_ids, sel_env).item()

    curve = pretrain(lm, lm_steps, len(ids), lm_loss, selection_loss, seed, log)
    lap("lm_train")

    torch.manual_seed(seed + 2)
    sampled = run_episodes(hf_turns(lm, greedy=False), tokenizer, held_out * EVAL_SAMPLES)
    greedy = run_episodes(hf_turns(lm, greedy=True), tokenizer, held_out)
    metrics = {f"held_out_sampled_{k}": v for k, v in episode_metrics(sampled).items()}
    metrics.update({f"held_out_greedy_{k}": v for k, v in episode_metrics(greedy).items()})
    metrics["selection_loss"] = curve["selected_loss"]
    log(f"metrics: {metrics}")
    lap("evaluate")
    if band is not None:
        band.check(metrics, seed, lm_steps)
    lm.save_pretrained(paths.policy)
    tokenizer.save_pretrained(paths.policy)
    lap("save")
    return {
        "build_threads": BUILD_THREADS,
        "special_token_ids": {"pad": PAD_ID, "eos": EOS_ID},
        "tool_call_token_id": TOOL_CALL_ID,
        "episode": {
            "max_turns": MAX_TURNS,
            "turn_max_tokens": TURN_MAX_TOKENS,
            "stop_token_ids": list(STOP_IDS),
            "eval_samples": EVAL_SAMPLES,
        },
        "corpus_mix": {
            "bad_kinds": BAD_KINDS,
            "direct_correct_frac": DIRECT_CORRECT_FRAC,
            "short_product_frac": SHORT_PRODUCT_FRAC,
        },
        "sizes": sizes,
        "metrics": {k: round(v, 4) for k, v in metrics.items()},
        "band": None if band is None else band.describe(),
        "selection": {"step": curve["selected_step"], "loss_by_step": curve["loss_by_step"]},
        "timings_s": lap.timings,
    }


def grouped_lm_loss(lm: Any, seqs: list[list[int]], env: list[list[int]]) -> Any:
    """The mean next-token loss over the trained tokens of `seqs` (not padding, not the environment's:
    `env` 1). Direct answers (19 tokens) and conversations with a call (up to 46) run as separate padded
    groups, each weighted by its token count: the loss of one padded batch at ~40% less compute."""
    total, count = 0.0, 0
    for group in (
        [i for i, s in enumerate(seqs) if len(s) <= SHORT_ROW],
        [i for i, s in enumerate(seqs) if len(s) > SHORT_ROW],
    ):
        if not group:
            continue
        input_ids, mask = pad([seqs[i] for i in group])
        by_env, _ = pad([env[i] for i in group])
        labels = input_ids.masked_fill((mask == 0) | (by_env == 1), -100)
        n = int((labels[:, 1:] != -100).sum())  # the tokens the shifted loss averages over
        total = total + n * lm(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        count += n
    return total / count


def pretrain(
    lm: Any, steps: int, n_rows: int, loss_of: Callable, select_loss: Callable[[], float], seed: int, log: Log
) -> dict:
    """`demos.common.pretrain_selected` with this demo's settings: the weights with the lowest
    `select_loss` (LM loss on the selection transcripts) are kept (ties: the later)."""
    curve = pretrain_selected(
        lm,
        steps,
        n_rows,
        loss_of,
        select_loss,
        seed,
        log,
        batch=LM_BATCH,
        lr=LM_LR,
        schedule=lambda opt, n: warmup_cosine(opt, n, LM_WARMUP_FRAC, LM_MIN_LR_RATE),
        select_every=LM_SELECT_EVERY,
        higher_is_better=False,
        what="selection loss",
        log_every=100,
    )
    return {
        "selected_step": curve["selected_step"],
        "selected_loss": curve["selected_score"],
        "loss_by_step": curve["score_by_step"],
    }


def hf_turns(lm: Any, greedy: bool, max_new_tokens: int = TURN_MAX_TOKENS) -> TurnSampler:
    """A TurnSampler from a causal LM: temperature-1 samples (or greedy), streams batched by length."""
    import torch

    def sample(streams: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in streams]
        by_len: dict[int, list[int]] = {}
        for i, s in enumerate(streams):
            by_len.setdefault(len(s), []).append(i)
        for n, rows in by_len.items():
            room = min(max_new_tokens, N_POSITIONS - n)
            if room < 1:
                continue
            ids = torch.tensor([streams[i] for i in rows])
            with torch.no_grad():
                gen = lm.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=not greedy,
                    temperature=None if greedy else 1.0,
                    top_k=None if greedy else 0,
                    top_p=None if greedy else 1.0,
                    max_new_tokens=room,
                    pad_token_id=PAD_ID,
                    eos_token_id=list(STOP_IDS),
                )
            for i, row in zip(rows, gen[:, n:].tolist(), strict=True):
                stop = next((j for j, t in enumerate(row) if t in STOP_IDS), len(row) - 1)
                out[i] = row[: stop + 1]
        return out

    return sample


# --- the band ---


@dataclass(frozen=True)
class Band:
    """The quality a build must reach on the held-out problems, sampled at temperature 1: accuracy at
    most `sampled_max` (RL has room), a tool-call rate in [call_rate_min, call_rate_max] (the policy
    calls sometimes, not never, not always), and accuracy given a well-formed call at least
    `given_call_min` (it can use the tool: calling is what RL has to make it do)."""

    sampled_max: float = 0.3
    call_rate_min: float = 0.1
    call_rate_max: float = 0.6
    given_call_min: float = 0.85

    def describe(self) -> dict[str, float]:
        return {
            "sampled_max": self.sampled_max,
            "call_rate_min": self.call_rate_min,
            "call_rate_max": self.call_rate_max,
            "given_call_min": self.given_call_min,
        }

    def misses(self, metrics: dict[str, float]) -> list[str]:
        acc = metrics["held_out_sampled_accuracy"]
        rate = metrics["held_out_sampled_tool_call_rate"]
        given = metrics["held_out_sampled_accuracy_given_call"]
        out = []
        if acc > self.sampled_max:
            out.append(f"held-out sampled accuracy {acc:.3f} > {self.sampled_max}")
        if not self.call_rate_min <= rate <= self.call_rate_max:
            out.append(f"tool-call rate {rate:.3f} outside [{self.call_rate_min}, {self.call_rate_max}]")
        if given < self.given_call_min:
            out.append(f"accuracy given a call {given:.3f} < {self.given_call_min}")
        return out

    def check(self, metrics: dict[str, float], seed: int, lm_steps: int) -> None:
        misses = self.misses(metrics)
        if misses:
            raise BuildQualityError(
                f"calculator build (seed {seed}, {lm_steps} pretraining steps) missed its quality band "
                f"(held-out sampled accuracy <= {self.sampled_max}, tool-call rate in "
                f"[{self.call_rate_min}, {self.call_rate_max}], accuracy given a call >= "
                f"{self.given_call_min}): {'; '.join(misses)}. Nothing was published. "
                "Try more steps (--lm-steps) or report it with the manifest's versions."
            )


BAND = Band()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demos.calculator", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder to build into, e.g. assets/calculator_tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lm-steps", type=int, default=LM_STEPS)
    parser.add_argument("--tool-frac", type=float, default=TOOL_FRAC)
    parser.add_argument("--bad-frac", type=float, default=BAD_TOOL_FRAC)
    parser.add_argument("--no-band", action="store_true", help="publish even if the policy misses the band")
    parser.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build is there")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    kw = dict(lm_steps=args.lm_steps, tool_frac=args.tool_frac, bad_frac=args.bad_frac)
    return report_build(
        lambda: ensure_assets(
            args.out, args.seed, check_band=not args.no_band, quiet=args.quiet, force=args.force, **kw
        )
    )


if __name__ == "__main__":
    sys.exit(main())
