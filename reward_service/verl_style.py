"""The verl adapter: a verl-style `compute_score(data_source, solution_str, ground_truth, extra_info)`
works unchanged, called with keywords as verl's reward managers call it.

From a sample's row: `data_source` is the `data_source` column (None when the row has none),
`ground_truth` the `ground_truth` column or, as verl's parquet files nest it, `reward_model.ground_truth`
(a row with neither fails: there is nothing to score against), `extra_info` the `extra_info` column or,
without one, the whole row; `solution_str` is the decoded response. The result is a score, or a dict
whose `score` key holds it (verl's richer results); `extra_info` is passed only when the function takes it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from reward_service.functions import RewardInput

PARAMETERS = ("data_source", "solution_str", "ground_truth")  # the names that mark the verl form


def ground_truth(meta: dict[str, Any]) -> Any:
    """The row's `ground_truth` column, else its `reward_model.ground_truth`; KeyError naming both."""
    if "ground_truth" in meta:
        return meta["ground_truth"]
    nested = meta.get("reward_model")
    if isinstance(nested, dict) and "ground_truth" in nested:
        return nested["ground_truth"]
    raise KeyError(
        "a verl-style function needs the row's 'ground_truth' column or 'reward_model.ground_truth'; "
        f"the row has columns {sorted(meta)}"
    )


@functools.cache
def takes_extra_info(fn: Callable) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == "extra_info" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def verl_call(fn: Callable, x: RewardInput) -> Any:
    """Call `fn` on one sample the way verl does (keywords), from the row's columns."""
    kwargs = {
        "data_source": x.meta.get("data_source"),
        "solution_str": x.response,
        "ground_truth": ground_truth(x.meta),
    }
    if takes_extra_info(fn):
        kwargs["extra_info"] = x.meta.get("extra_info", x.meta)
    return fn(**kwargs)


def verl_score(result: Any) -> Any:
    """The score of a verl result: a dict's `score` key, anything else as it is (checked by the caller)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise KeyError(f"a verl-style result dict needs a 'score' key; it has {sorted(result)}")
        return result["score"]
    return result
