"""Self-contained demos: each module builds its own offline assets (data, tokenizer, tiny models) and
has its run config in `configs/`. Nothing here is imported by a run unless the config's
`model.demo_assets` asks for a build.

- `sentiment`: a tiny GPT-2 learns to write positive movie reviews, rewarded by a tiny classifier.
- `arithmetic`: a tiny GPT-2 learns two-digit addition, rewarded by an exact-match rule.
- `calculator`: a tiny GPT-2 learns to call a calculator tool (multi-turn) for two-digit multiplication,
  rewarded by an exact-match rule on its last turn.
"""

from __future__ import annotations

import importlib
from pathlib import Path

DEMOS = {"sentiment": "demos.sentiment", "arithmetic": "demos.arithmetic", "calculator": "demos.calculator"}


class DemoBuildError(RuntimeError):
    """A demo's asset build finished but its result is unusable (e.g. a policy outside its quality band);
    the message says what was measured and what was required."""


class BuildQualityError(DemoBuildError):
    """A pretrained policy missed the quality band RL is tuned for (the demo's `Band`); nothing was
    published."""


def ensure_demo(name: str, folder: str | Path, quiet: bool = False) -> Path:
    """Build demo `name`'s assets into `folder` unless an up-to-date build is there; returns the folder."""
    if name not in DEMOS:
        raise ValueError(f"unknown demo {name!r}; one of {', '.join(sorted(DEMOS))}")
    return importlib.import_module(DEMOS[name]).ensure_assets(folder, quiet=quiet).root
