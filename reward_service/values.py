"""What counts as a score, the one check every reward source passes: a finite real number. A bool, a
string, None, a tensor or NaN/inf is no score; the sample it was meant for fails (never a made-up 0)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def score_problem(value: Any) -> str | None:
    """Why `value` is no score (worded to follow "<source> "), or None when it is one."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return f"returned {type(value).__name__} {value!r}, not a number"
    if not math.isfinite(float(value)):
        return f"returned a non-finite score ({value})"
    return None
