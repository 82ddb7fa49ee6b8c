"""Prompt data: read, render, tokenize and validate once; hand out batches in a seeded, resumable order.

A row's prompt column (`data.prompt_key`) holds a string (plain text), a list of chat messages, or those
messages as JSON text (`chat.json_messages`: read as messages and counted); every other column is the prompt's meta, handed as is to rule/remote rewards and environments. Files and row
identity: `cluster.prompts.prompt_files`; messages and templates: `cluster.prompts.chat`.

Plain text is tokenized without special tokens, then the BOS is prepended (`data.add_bos`); an
over-long one is cut from the left or skipped (`data.long_prompt`). A chat prompt (messages, or a string
with `data.wrap_string_prompts`) is the chat template's rendering, ids exactly as apply_chat_template
gives them; an over-long one is skipped, never cut. Both are counted (`DataStats`), and said before
the run starts (`RunPrompts.notices`: what `cluster.train` prints and `cluster.data` shows).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.config.schema import ConfigError, DataSection, RunConfig
from cluster.prompts.chat import ChatTemplate, chat_template, check_messages, json_messages
from cluster.prompts.prompt_files import read_rows

JSON_SCALARS = (str, int, float, bool, type(None))
SHOWN_SKIPPED = 3


@dataclass
class Prompt:
    index: int  # position in the prompts files (`prompt_files`): the identity for exactly-once accounting
    text: str  # what the rest of the run sees: the plain text, or a chat prompt's rendered template
    ids: np.ndarray
    meta: dict = field(default_factory=dict)  # the row's other columns
    # a chat prompt's messages as rendered (data.system_prompt included); None for plain text
    messages: list[dict] | None = None


@dataclass
class DataStats:
    rows: int = 0
    empty: int = 0
    truncated: int = 0  # plain text cut from the left (data.long_prompt='truncate')
    skipped_long: int = 0  # over data.max_prompt_tokens: chat prompts always, plain text with 'skip'
    longest_skipped: int = 0  # tokens of the longest skipped prompt
    skipped_rows: list[str] = field(default_factory=list)  # where the first SHOWN_SKIPPED skipped rows are
    json_messages: int = 0  # string prompts read as JSON chat messages (`chat.json_messages`)

    def skip(self, where: str, tokens: int) -> None:
        self.skipped_long += 1
        self.longest_skipped = max(self.longest_skipped, tokens)
        if len(self.skipped_rows) < SHOWN_SKIPPED:
            self.skipped_rows.append(where)

    def lines(self, cfg: DataSection) -> list[str]:
        """What was dropped, cut or read otherwise than as written, one line each, each naming the setting
        that decides it and what to set; [] when every row was used as written."""
        lines = []
        if self.empty:
            lines.append(f"dropped {self.empty} empty (a blank string or no messages)")
        if self.skipped_long:
            lines.append(
                f"skipped {self.skipped_long} over data.max_prompt_tokens={cfg.max_prompt_tokens} (the longest "
                f"{self.longest_skipped} tokens; set data.max_prompt_tokens to {self.longest_skipped} or more to "
                "keep them), e.g. " + "; ".join(self.skipped_rows)
            )
        if self.truncated:
            lines.append(
                f"cut {self.truncated} plain-text prompts to their last tokens (data.long_prompt='truncate'; "
                "'skip' drops them instead)"
            )
        if self.json_messages:
            lines.append(
                f"read {self.json_messages} string prompts (field {cfg.prompt_key!r}) as chat messages written "
                "as JSON text, rendered with the chat template"
            )
        return lines


@dataclass(frozen=True)
class PromptRow:
    """One row read from the prompts files: its prompt (text or messages) and its meta."""

    index: int
    where: str  # "file:LINE" or "file row N", for messages
    text: str | None  # a string prompt
    messages: list[dict[str, Any]] | None  # a chat-messages prompt
    meta: dict[str, Any]
    from_json: bool = False  # messages read from a string of JSON text (`chat.json_messages`)


def _check_meta(value: Any, where: str, column: str) -> None:
    """Meta values are JSON values (they reach remote rewards as JSON and environments across processes)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{where}: field {column!r}: object key {k!r} is not a string")
            _check_meta(v, where, column)
    elif isinstance(value, list):
        for v in value:
            _check_meta(v, where, column)
    elif not isinstance(value, JSON_SCALARS):
        raise ConfigError(
            f"{where}: field {column!r} holds a {type(value).__name__}; meta values are JSON values "
            "(string, number, boolean, null, lists and objects of them): convert or drop the column"
        )


def read_prompts(cfg: DataSection, option: str = "data.prompts_path") -> list[PromptRow]:
    """The rows of the files `cfg.prompts_path` names (`option`: its name, for messages), each
    checked: the prompt column present and a string or a valid messages list, `meta_keys` present."""
    key = cfg.prompt_key
    rows = []
    for raw in read_rows(cfg.prompts_path, option):
        if key not in raw.columns:
            has = ", ".join(sorted(raw.columns)) or "no fields"
            raise ConfigError(f"{raw.where}: missing field {key!r} (data.prompt_key); the row has {has}")
        missing = [k for k in cfg.meta_keys if k not in raw.columns]
        if missing:
            raise ConfigError(f"{raw.where}: missing field {missing[0]!r} (listed in data.meta_keys)")
        value = raw.columns[key]
        decoded = json_messages(value, raw.where, key) if isinstance(value, str) else None
        if decoded is not None:
            text, messages = None, decoded
        elif isinstance(value, str):
            text, messages = value, None
        elif isinstance(value, list):
            text, messages = None, check_messages(value, raw.where, key)
        else:
            raise ConfigError(
                f"{raw.where}: field {key!r} (data.prompt_key) is a {type(value).__name__}; allowed: a string "
                "or a list of chat messages"
            )
        meta = {k: v for k, v in raw.columns.items() if k != key}
        for column, v in meta.items():
            _check_meta(v, raw.where, column)
        rows.append(PromptRow(raw.index, raw.where, text, messages, meta, decoded is not None))
    if not rows:
        raise ConfigError(f"{option}: {cfg.prompts_path} holds no prompts")
    return rows


def load_tokenizer(cfg: RunConfig):
    """The run's tokenizer (model.tokenizer_path, else model.policy_path), from its folder."""
    from transformers import AutoTokenizer  # here, not at import: it imports torch

    try:
        return AutoTokenizer.from_pretrained(cfg.tokenizer_path)
    except (OSError, ValueError) as err:
        option = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.policy_path"
        raise ConfigError(f"{option}: cannot load a tokenizer from {cfg.tokenizer_path}: {err}") from None


def pad_token_id(tokenizer) -> int:
    """The id the learner pads with: the tokenizer's, by the one rule every role shares (`pad_id_of`)."""
    from kernel.sequences import pad_id_of  # here, not at import: it imports torch

    return pad_id_of(tokenizer)


def _plain_ids(row: PromptRow, tokenizer, cfg: DataSection, stats: DataStats) -> list[int] | None:
    """Plain text's ids: BOS (data.add_bos) + the text's tokens, cut from the left or skipped when long.

    `max_prompt_tokens` counts the BOS token; a truncated prompt keeps its BOS: the text is cut to the
    last `max_prompt_tokens - 1` tokens first, then BOS is prepended."""
    bos = tokenizer.bos_token_id if cfg.add_bos else None
    room = cfg.max_prompt_tokens - (bos is not None)  # text tokens that fit beside the BOS
    if room < 1:
        raise ConfigError(
            f"data.max_prompt_tokens={cfg.max_prompt_tokens} leaves no room for prompt text after the BOS "
            "token: raise it, or set data.add_bos=false"
        )
    ids = tokenizer(row.text, add_special_tokens=False)["input_ids"]
    if len(ids) > room:
        if cfg.long_prompt == "skip":
            stats.skip(row.where, len(ids) + (bos is not None))
            return None
        stats.truncated += 1
        ids = ids[-room:]
    return ids if bos is None else [bos, *ids]


def _chat(row: PromptRow, cfg: DataSection) -> list[dict[str, Any]] | None:
    """The messages a row is rendered from: its own, or its string as one user message
    (data.wrap_string_prompts); None for plain text."""
    if row.messages is not None:
        return row.messages
    return [{"role": "user", "content": row.text}] if cfg.wrap_string_prompts else None


def tokenize_prompts(
    rows: list[PromptRow], tokenizer, cfg: DataSection, option: str = "data.prompts_path"
) -> tuple[list[Prompt], DataStats]:
    """Empty prompts are dropped and over-long ones skipped or (plain text) truncated, all counted."""
    stats = DataStats(rows=len(rows), json_messages=sum(r.from_json for r in rows))
    template: ChatTemplate = chat_template(cfg, tokenizer)
    prompts: list[Prompt] = []
    for row in rows:
        if (row.text is not None and not row.text.strip()) or row.messages == []:
            stats.empty += 1
            continue
        messages = _chat(row, cfg)
        if messages is None:
            text, ids = row.text, _plain_ids(row, tokenizer, cfg, stats)
            if ids is None:
                continue
        else:
            messages = template.conversation(messages)
            text, ids = template.render(tokenizer, messages, f"{row.where}: field {cfg.prompt_key!r}")
            if len(ids) > cfg.max_prompt_tokens:
                stats.skip(row.where, len(ids))
                continue
        prompts.append(Prompt(row.index, text, np.asarray(ids, dtype=np.int64), row.meta, messages))
    if not prompts:
        raise ConfigError(
            f"{option}: no usable prompts ({stats.empty} empty, {stats.skipped_long} over "
            f"data.max_prompt_tokens={cfg.max_prompt_tokens}, the longest {stats.longest_skipped} tokens)"
        )
    return prompts, stats


def load_prompts(
    cfg: DataSection, tokenizer, option: str = "data.prompts_path"
) -> tuple[list[Prompt], DataStats]:
    """`read_prompts` then `tokenize_prompts`: the prompts a run hands out, and their counts."""
    return tokenize_prompts(read_prompts(cfg, option), tokenizer, cfg, option)


@dataclass
class RunPrompts:
    """A run's prompts, read once (in `cluster.train`'s preflight, before any actor starts)."""

    train: list[Prompt]
    stats: DataStats
    eval: list[Prompt]  # held-out (eval.prompts_path, its first eval.max_prompts); [] when evaluation is off
    eval_stats: DataStats | None = None

    def notices(self, cfg: RunConfig) -> list[str]:
        """What start-up says about the prompts before step 1: per set (training, held-out), each line of
        its `DataStats.lines`, naming the option and its files, the rows read and the prompts used."""
        sets = [("data.prompts_path", cfg.data.prompts_path, self.stats, len(self.train))]
        if self.eval_stats is not None:
            sets.append(("eval.prompts_path", cfg.eval.prompts_path, self.eval_stats, len(self.eval)))
        out = []
        for option, spec, stats, used in sets:
            head = f"{option} ({spec}): {stats.rows} rows, {used} prompts used"
            out += [f"{head}: {line}" for line in stats.lines(cfg.data)]
        return out

    def announce(self, cfg: RunConfig) -> None:
        """The `notices`, each a `warning:` line on stderr (a run's start-up, before any actor starts)."""
        for line in self.notices(cfg):
            print(f"warning: {line}", file=sys.stderr, flush=True)


def load_run_prompts(cfg: RunConfig, tokenizer) -> RunPrompts:
    """The training prompts and the held-out ones, the latter read and rendered like the former."""
    train, stats = load_prompts(cfg.data, tokenizer)
    if not cfg.eval.enabled:
        return RunPrompts(train, stats, [])
    section = cfg.data.model_copy(update={"prompts_path": cfg.eval.prompts_path})
    held_out, eval_stats = load_prompts(section, tokenizer, "eval.prompts_path")
    return RunPrompts(train, stats, held_out[: cfg.eval.max_prompts], eval_stats)


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
