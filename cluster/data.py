"""Command line: `python -m cluster.data CONFIG [--set a.b=c ...] [-n N]`: the prompts as the model sees them.

Reads and renders the config's prompts exactly as a run does (`cluster.prompts.loader`, which
`cluster.train`'s preflight calls too) and prints, for the training prompts and the held-out ones: the
first N prompts decoded from their ids with the special tokens visible, the length distribution in
tokens (min / median / p99 / max), the rows dropped and why, and the columns each prompt hands to the
reward as meta, and the names of the tools handed to the template (`data.tools`). Any problem (a
missing file or column, a wrong type, a bad message, a template that cannot render, a bad `data.tools`
entry) exits with code 2 and the message, which names the file, the row and the field.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np

from cluster.config.schema import ConfigError, DataSection
from cluster.prompts.chat import chat_template
from cluster.prompts.loader import DataStats, Prompt, load_run_prompts, load_tokenizer
from cluster.train import EXIT_BAD_INPUT, add_config_arguments, run_config


def length_line(prompts: list[Prompt], cfg: DataSection) -> str:
    lengths = np.array([len(p.ids) for p in prompts])
    p50, p99 = np.percentile(lengths, [50, 99])
    return (
        f"tokens: min {lengths.min()} / median {p50:g} / p99 {p99:g} / max {lengths.max()} "
        f"(data.max_prompt_tokens={cfg.max_prompt_tokens})"
    )


def dropped_lines(stats: DataStats, kept: int, cfg: DataSection) -> list[str]:
    return [f"rows: {stats.rows}, used {kept}", *(f"  {line}" for line in stats.lines(cfg))]


def meta_lines(prompts: list[Prompt]) -> list[str]:
    """Each meta column: its value types and how many prompts carry it."""
    types: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for p in prompts:
        for key, value in p.meta.items():
            types[key][type(value).__name__] += 1
    if not types:
        return ["meta to the reward: none (the rows have no column besides the prompt)"]
    lines = ["meta to the reward (columns besides the prompt):"]
    for key in sorted(types):
        seen = ", ".join(f"{t}" for t in sorted(types[key]))
        lines.append(f"  {key}: {seen} ({sum(types[key].values())} of {len(prompts)} prompts)")
    return lines


def prompt_lines(prompts: list[Prompt], tokenizer, n: int) -> list[str]:
    lines = []
    for p in prompts[:n]:
        kind = "chat" if p.messages is not None else "text"
        lines.append(f"--- prompt {p.index} ({kind}, {len(p.ids)} tokens) ---")
        lines.append(tokenizer.decode(p.ids.tolist(), skip_special_tokens=False))
        lines.append(f"--- meta: {json.dumps(p.meta, ensure_ascii=False)}")
    return lines


def tool_name(schema) -> str:
    function = schema.get("function", schema) if isinstance(schema, dict) else None
    return str(function.get("name", "?")) if isinstance(function, dict) else "?"


def report(
    title: str, prompts: list[Prompt], stats: DataStats, cfg: DataSection, tokenizer, n: int
) -> list[str]:
    chat = sum(p.messages is not None for p in prompts)
    template = chat_template(cfg, tokenizer)
    tools = [tool_name(t) for t in template.kwargs.get("tools") or []]
    return [
        f"=== {title} ===",
        *dropped_lines(stats, len(prompts), cfg),
        f"chat prompts: {chat} of {len(prompts)} (rendered with {template.source}); plain text: {len(prompts) - chat}",
        *([f"tools the template is given: {', '.join(tools)}"] if chat and tools else []),
        length_line(prompts, cfg),
        *meta_lines(prompts),
        *prompt_lines(prompts, tokenizer, n),
    ]


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m cluster.data",
        description="Show the prompts as the model will see them, and check every row.",
    )
    add_config_arguments(ap)
    ap.add_argument("-n", type=_count, default=3, help="prompts printed per set (default 3)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = run_config(args)
        tokenizer = load_tokenizer(cfg)
        data = load_run_prompts(cfg, tokenizer)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    lines = report(
        f"training prompts ({cfg.data.prompts_path})", data.train, data.stats, cfg.data, tokenizer, args.n
    )
    if data.eval_stats is not None:
        first = f", the first eval.max_prompts={cfg.eval.max_prompts}" if cfg.eval.max_prompts else ""
        held_out = f"held-out prompts ({cfg.eval.prompts_path}{first})"
        lines += ["", *report(held_out, data.eval, data.eval_stats, cfg.data, tokenizer, args.n)]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
