"""What every demo's asset build shares: an atomic, locked, up-to-date-checked build folder, and the
tiny GPT-2 pieces (config, padding, seeded training loops: plain, and with checkpoint selection), the
near-miss numbers the arithmetic corpora use, and the folder layout and command-line report of the
rule-reward demos (`RuleDemoPaths`, `report_build`).

A build writes into a temporary sibling folder and renames it into place at the end: a folder with a
`manifest.json` is always complete, and a second call with the same settings is a no-op.
"""

from __future__ import annotations

import contextlib
import json
import math
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

from demos import BuildQualityError

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BUILD_THREADS = 2
LOCK_TIMEOUT_S = 900.0

Log = Callable[[str], None]


@dataclass(frozen=True)
class RuleDemoPaths:
    """A rule-reward demo's folder: the policy (model and tokenizer), the RL prompts and the held-out
    prompts (no reward model: the rule is code)."""

    root: Path
    policy: Path
    prompts: Path
    eval_prompts: Path

    @classmethod
    def under(cls, root: Path) -> RuleDemoPaths:
        return cls(root, root / "policy", root / "prompts.jsonl", root / "eval_prompts.jsonl")

    @classmethod
    def complete(cls, root: Path) -> bool:
        """Does `root` hold every part (`ensure_built`'s completeness check)?"""
        p = cls.under(root)
        return p.policy.is_dir() and p.prompts.is_file() and p.eval_prompts.is_file()


def report_build(build: Callable[[], RuleDemoPaths]) -> int:
    """A rule demo's command line: run `build`, then print the manifest's timings, sizes, metrics and
    band (exit 0), or the band it missed (exit 1)."""
    t0 = time.perf_counter()
    try:
        paths = build()
    except BuildQualityError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    m = read_manifest(paths.root) or {}
    print(f"assets: {paths.root} ({time.perf_counter() - t0:.1f} s)")
    for section in ("timings_s", "sizes", "metrics", "band"):
        print(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in (m.get(section) or {}).items()))
    return 0


def read_manifest(root: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(root) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def manifest_matches(root: Path, want: dict[str, Any]) -> bool:
    m = read_manifest(root)
    return m is not None and all(m.get(k) == v for k, v in want.items())


def logger(quiet: bool) -> Log:
    return (lambda _msg: None) if quiet else (lambda msg: print(msg, flush=True))


def ensure_built(
    root: Path,
    want: dict[str, Any],
    is_complete: Callable[[Path], bool],
    build: Callable[[Path, Log], dict],
    log: Log,
    force: bool = False,
) -> bool:
    """Build into `root` with `build(tmp_folder, log) -> manifest` unless its manifest already holds
    `want` and `is_complete(root)`. Returns True when it built."""

    def current() -> bool:
        return not force and manifest_matches(root, want) and is_complete(root)

    if current():
        return False
    check_replaceable(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(root.parent / f".{root.name}.lock"):
        if current():  # built by a concurrent caller
            return False
        for stale in [
            *root.parent.glob(f".{root.name}.building-*"),
            *root.parent.glob(f".{root.name}.old-*"),
        ]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed build; we hold the lock
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the published folder should read like any other
        try:
            manifest = {**build(tmp, log), **want, "versions": versions()}
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            _publish(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"assets ready in {root}")
    return True


def check_replaceable(root: Path) -> None:
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
def file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Serialise builders of the same folder (e.g. `make train` and a test running together)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=timeout_s)
    except Timeout:
        raise TimeoutError(f"another process held {path} for over {timeout_s:.0f} s") from None
    try:
        yield
    finally:
        lock.release()


def bos_tokenizer(tok: Any, max_length: int) -> Any:
    """A `tokenizers.Tokenizer` whose ids 0/1/2 are <pad>/<bos>/<eos> as a transformers tokenizer that
    prepends <bos> to every text."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=max_length,
    )


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSON lines through a temporary file renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def write_parquet(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as a parquet file (columns from the rows' keys; lists of dicts become list<struct>)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def load_prompts(path: str | Path) -> list[str]:
    """Prompt texts from a JSON-lines file of {"prompt": str} objects, read like a run reads them."""
    from cluster.config.schema import DataSection
    from cluster.prompts.loader import read_prompts

    return [row.text for row in read_prompts(DataSection(prompts_path=str(path)))]


# --- torch side; imported lazily so the up-to-date check stays instant ---


@contextlib.contextmanager
def quiet_deterministic_torch(threads: int = BUILD_THREADS) -> Iterator[None]:
    """A fixed thread count (the same seed gives the same bytes), HF logging hushed, and the caller's
    global RNG and settings restored afterwards."""
    import torch
    from transformers.utils import logging as hf_logging

    prev = torch.get_num_threads(), hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()  # hides generate's harmless pad-after-EOS attention-mask warning
    hf_logging.disable_progress_bar()
    try:
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
            yield
    finally:
        torch.set_num_threads(prev[0])
        hf_logging.set_verbosity(prev[1])
        if prev[2]:
            hf_logging.enable_progress_bar()


class Laps:
    """Wall time of each build phase, logged as it ends."""

    def __init__(self, log: Log) -> None:
        self.log, self.timings, self.t0 = log, {}, time.perf_counter()

    def __call__(self, name: str) -> None:
        self.timings[name] = round(time.perf_counter() - self.t0, 2)
        self.log(f"[{name}] done in {self.timings[name]:.1f} s")
        self.t0 = time.perf_counter()


def gpt2_config(vocab_size: int, n_layer: int, n_embd: int, n_head: int, n_positions: int = 64) -> Any:
    from transformers import GPT2Config

    # Dropout 0 everywhere: RL needs deterministic forwards, and GPT-2 dropout consumes the global RNG.
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    ids = dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    size = dict(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head)
    return GPT2Config(**size, **no_dropout, **ids)


def set_generation_ids(lm: Any, bos_id: int | None = BOS_ID) -> None:
    """The demos' pad / BOS / EOS ids in the model's generation config (and its BOS in the model config);
    `bos_id` None for a tokenizer without BOS (a chat template that opens every message itself)."""
    lm.config.bos_token_id = bos_id
    gen = lm.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = PAD_ID, bos_id, EOS_ID


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def pad(seqs: list[list[int]]) -> tuple[Any, Any]:
    import torch

    ids = torch.full((len(seqs), max(map(len, seqs))), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def train_loop(
    model: Any,
    steps: int,
    lr: float,
    rows: range,
    loss_of: Callable,
    g: Any,
    log: Log,
    name: str,
    batch_size: int = 64,
) -> None:
    """AdamW, short linear warm-up then cosine decay, batches drawn as seeded epoch permutations."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    order: list[int] = []
    model.train()
    for step in range(steps):
        if len(order) < batch_size:
            order += [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
        batch, order = order[:batch_size], order[batch_size:]
        loss = loss_of(batch, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  {name} step {step + 1}/{steps} loss {loss.item():.3f}")
    model.eval()


def near_miss(rng: Any, value: int, offsets: tuple[int, ...]) -> int:
    """A plausible wrong number: `value` plus one of `offsets`, or (a fifth of the time, from two digits
    on) two adjacent digits swapped; never `value`, never negative."""
    while True:
        if rng.random() < 0.2 and value >= 10:
            digits = list(str(value))
            i = rng.randrange(len(digits) - 1)
            digits[i], digits[i + 1] = digits[i + 1], digits[i]
            wrong = int("".join(digits))
        else:
            wrong = value + rng.choice(offsets)
        if wrong != value and wrong >= 0:
            return wrong


def warmup_cosine(opt: Any, steps: int, warmup_frac: float, min_lr_rate: float) -> Any:
    """transformers' linear warm-up (`warmup_frac` of the steps) then cosine decay to `min_lr_rate` x lr."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    warm = max(1, round(warmup_frac * steps))
    return get_cosine_with_min_lr_schedule_with_warmup(opt, warm, steps, min_lr_rate=min_lr_rate)


def selection_steps(steps: int, every: int) -> list[int]:
    """The steps (1-based, after the optimizer step) whose weights are candidates: every `every`-th step
    in the second half of the run, and the last one."""
    return sorted({s for s in range(every, steps + 1, every) if 2 * s > steps} | {steps})


def pretrain_selected(
    lm: Any,
    steps: int,
    n_rows: int,
    loss_of: Callable,
    score: Callable[[], float],
    seed: int,
    log: Log,
    *,
    batch: int,
    lr: float,
    schedule: Callable[[Any, int], Any],
    select_every: int,
    higher_is_better: bool,
    what: str,
    log_every: int,
) -> dict:
    """AdamW under `schedule(opt, steps)`, batches of `batch` drawn as seeded epoch permutations of
    `n_rows`; at each of `selection_steps` the weights are scored by `score` (`what` in the log) and the
    best kept (ties: the later). Loads the selected weights into `lm`; returns the selected step, its
    score and the score at every candidate step."""
    import copy

    import torch

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(lm.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = schedule(opt, steps)
    candidates = set(selection_steps(steps, select_every))
    sign = 1.0 if higher_is_better else -1.0
    order: list[int] = []
    best: tuple[float, int, dict] | None = None
    by_step: dict[int, float] = {}
    lm.train()
    for step in range(1, steps + 1):
        while len(order) < batch:
            order += torch.randperm(n_rows, generator=g).tolist()
        rows, order = order[:batch], order[batch:]
        loss = loss_of(rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        sched.step()
        if step in candidates:
            lm.eval()
            value = score()
            lm.train()
            by_step[step] = round(value, 4)
            if best is None or sign * value >= sign * best[0]:
                best = (value, step, copy.deepcopy(lm.state_dict()))
            log(f"  lm step {step}/{steps} loss {loss.item():.3f} {what} {value:.4f}")
        elif step % log_every == 0 or step == 1:
            log(f"  lm step {step}/{steps} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e}")
    assert best is not None
    lm.load_state_dict(best[2])
    lm.eval()
    log(f"  selected the weights of step {best[1]} ({what} {best[0]:.4f})")
    return {"selected_step": best[1], "selected_score": best[0], "score_by_step": by_step}


def versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    mods = {"torch": torch, "transformers": transformers, "tokenizers": tokenizers}
    return {"python": platform.python_version(), **{k: m.__version__ for k, m in mods.items()}}
