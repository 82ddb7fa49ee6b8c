"""Prompt data: load, tokenize and validate once; hand out batches in a seeded, resumable order."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.config.schema import ConfigError, DataSection


@dataclass
class Prompt:
    index: int  # line number in the prompts file: the identity used for exactly-once accounting
    text: str
    ids: np.ndarray
    meta: dict = field(default_factory=dict)


@dataclass
class DataStats:
    total_lines: int = 0
    empty: int = 0
    truncated: int = 0
    skipped_long: int = 0


def read_prompts(cfg: DataSection) -> list[tuple[int, str, dict]]:
    path = Path(cfg.prompts_path)
    if not path.is_file():
        raise ConfigError(f"data.prompts_path: file not found: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{lineno + 1}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict) or cfg.prompt_key not in obj:
            raise ConfigError(f"{path}:{lineno + 1}: missing key {cfg.prompt_key!r} (data.prompt_key)")
        meta = {k: obj[k] for k in cfg.meta_keys if k in obj}
        rows.append((lineno, str(obj[cfg.prompt_key]), meta))
    if not rows:
        raise ConfigError(f"data.prompts_path: {path} holds no prompts")
    return rows


def pad_token_id(tokenizer) -> int:
    """The id the learner pads with: the tokenizer's, by the one rule every role shares (`pad_id_of`)."""
    from learner.sequences import pad_id_of  # here, not at import: it imports torch

    return pad_id_of(tokenizer)


def tokenize_prompts(
    rows: list[tuple[int, str, dict]], tokenizer, cfg: DataSection
) -> tuple[list[Prompt], DataStats]:
    """Empty prompts are dropped (counted); over-long ones are truncated from the left or skipped.

    `max_prompt_tokens` counts the BOS token; a truncated prompt keeps its BOS: the text is cut to the
    last `max_prompt_tokens - 1` tokens first, then BOS is prepended.
    """
    stats = DataStats(total_lines=len(rows))
    bos = tokenizer.bos_token_id if cfg.add_bos else None
    room = cfg.max_prompt_tokens - (bos is not None)  # text tokens that fit beside the BOS
    if room < 1:
        raise ConfigError(
            f"data.max_prompt_tokens={cfg.max_prompt_tokens} leaves no room for prompt text after the BOS "
            "token: raise it, or set data.add_bos=false"
        )
    prompts: list[Prompt] = []
    for index, text, meta in rows:
        if not text.strip():
            stats.empty += 1
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > room:
            if cfg.long_prompt == "skip":
                stats.skipped_long += 1
                continue
            stats.truncated += 1
            ids = ids[-room:]
        if bos is not None:
            ids = [bos, *ids]
        prompts.append(Prompt(index, text, np.asarray(ids, dtype=np.int64), meta))
    if not prompts:
        raise ConfigError(
            f"data.prompts_path: no usable prompts ({stats.empty} empty, {stats.skipped_long} over "
            f"data.max_prompt_tokens={cfg.max_prompt_tokens})"
        )
    return prompts, stats


class PromptStream:
    """Endless epochs over the prompts; the position (epoch, offset) is all the state to resume."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool) -> None:
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self, size: int) -> list[Prompt]:
        batch = []
        while len(batch) < size:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._order_for(self.epoch)
            take = min(size - len(batch), len(self._order) - self.offset)
            batch.extend(self.prompts[i] for i in self._order[self.offset : self.offset + take])
            self.offset += take
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._order_for(self.epoch)
