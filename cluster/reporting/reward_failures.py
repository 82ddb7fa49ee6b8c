"""Reward failures below the abort threshold, made visible: the run's first `SHOWN` failed samples are
printed with their prompt row and the error, and kept in the run folder (`reward_failures.jsonl`, one
JSON object a line); every failure is counted in the metrics (rollout/reward_failures, and per reward
function reward_failures/<name>, `cluster.reporting.metrics`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.records.chunks import Parts, env_failed

SHOWN = 10  # failures printed and kept per run (the rest are counted only)
FILE = "reward_failures.jsonl"
PROMPT_CHARS = 200  # of a prompt's text, in the console line (the file keeps it whole)


@dataclass(frozen=True)
class RewardFailure:
    """One failed sample's reward, as the console and the run folder show it."""

    when: str  # "step 3", "held-out evaluation at step 2"
    row: int  # the prompt's row (its index in the prompts files)
    prompt: str
    meta: dict[str, Any]
    error: str

    def line(self) -> str:
        text = self.prompt if len(self.prompt) <= PROMPT_CHARS else self.prompt[: PROMPT_CHARS - 3] + "..."
        return f"reward failed ({self.when}) on prompt row {self.row} {text!r} meta {self.meta}: {self.error}"


def reward_failures(parts: Parts, when: str) -> list[RewardFailure]:
    """Every sample of `parts` whose reward failed (episodes whose environment failed are the
    environment's failures, not the reward's), with its prompt row."""
    out = []
    for chunk, positions in parts:
        prompts = {p.index: p for p in chunk.prompts}
        for j in positions:
            if chunk.scores.ok[j] or env_failed(chunk, j):
                continue
            p = prompts[chunk.facts[j].prompt_index]
            error = chunk.scores.errors[j] or "unknown reward error"
            out.append(RewardFailure(when, p.index, p.text, dict(p.meta), error))
    return out


class RewardFailureLog:
    """The run's first `limit` reward failures, printed and appended to `run_dir/reward_failures.jsonl`
    (None: printed only); past the limit one line says where the rest are counted."""

    def __init__(self, run_dir: Path | None, limit: int = SHOWN) -> None:
        self.path = None if run_dir is None else Path(run_dir) / FILE
        self.limit, self.shown, self.told = limit, 0, False

    def record(self, parts: Parts, when: str) -> None:
        failures = reward_failures(parts, when)
        first = failures[: max(0, self.limit - self.shown)]
        for f in first:
            print(f.line(), flush=True)
        if first and self.path is not None:
            with self.path.open("a") as out:
                out.writelines(json.dumps(asdict(f)) + "\n" for f in first)
        self.shown += len(first)
        if len(failures) > len(first) and not self.told:
            self.told = True
            where = f" (the first {self.limit} are in {self.path})" if self.path is not None else ""
            print(
                f"further reward failures are not shown{where}: rollout/reward_failures and "
                "reward_failures/<function> count them",
                flush=True,
            )
