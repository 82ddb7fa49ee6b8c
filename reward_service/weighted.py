"""The configured reward functions (`RewardConfig.function_entries`): loaded by name or from a module,
and scored together as a weighted sum.

A sample's score is sum(weight * value) over the functions; every function runs on every sample and
keeps its own values (unweighted: the reward/<name> metrics). A function that raises, returns no
finite number, or (batched) returns no list of one score per input fails the samples it was meant for;
a sample any function failed on has no score (NaN) and carries every such function's message.
A call that does not return within reward.function_timeout_s raises `RewardFunctionTimeout` naming the
function, the rows it was scoring and the timeout. Loading errors are ValueErrors naming the config field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from reward_service.config import FunctionEntry, RewardConfig
from reward_service.forms import FORMS, Failed, Hung, call_form, detect_form
from reward_service.functions import RewardInput
from reward_service.rules import get_reward, import_user_module
from reward_service.values import score_problem


@dataclass(frozen=True)
class RewardFunction:
    name: str  # its metric is reward/<name>
    weight: float
    fn: Callable
    form: str  # a key of reward_service.forms.FORMS


class RewardFunctionTimeout(RuntimeError):
    """A reward function did not return within reward.function_timeout_s (the run stops: a hung call
    cannot be interrupted)."""


@dataclass
class WeightedScores:
    """Scores of n inputs: the weighted sum (NaN where any function failed), each function's own values
    (NaN where it failed) and per input the failures' messages, joined (None where all succeeded)."""

    total: np.ndarray  # float64 [n]
    values: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float64 [n]
    errors: list[str | None] = field(default_factory=list)
    failed: dict[str, np.ndarray] = field(default_factory=dict)  # name -> bool [n]: the function failed there


def load_functions(config: RewardConfig) -> list[RewardFunction]:
    """The functions of `config` (kind='rule'), each resolved and its form known."""
    out = []
    for entry in config.function_entries():
        fn = resolve(entry)
        form = detect_form(
            fn, entry.spec.style, entry.style_field if entry.spec.style != "auto" else _where(entry)
        )
        out.append(RewardFunction(entry.spec.metric_name, float(entry.spec.weight), fn, form))
    return out


def _where(entry: FunctionEntry) -> str:
    return entry.module_field if entry.spec.module else entry.name_field


def resolve(entry: FunctionEntry) -> Callable:
    """The callable an entry names: 'file.py:function' / 'module:function', or a registered rule (after
    importing a module that registers it)."""
    spec = entry.spec
    if spec.module and ":" in spec.module:
        path, attr = spec.module.rsplit(":", 1)
        module = import_user_module(path, entry.module_field)
        fn = getattr(module, attr, None)
        if fn is None:
            raise ValueError(f"{entry.module_field}: no function {attr!r} in {path}")
        if not callable(fn):
            raise ValueError(
                f"{entry.module_field}: {attr!r} in {path} is a {type(fn).__name__}, not a function"
            )
        return fn
    if spec.module:
        import_user_module(spec.module, entry.module_field)
    try:
        return get_reward(spec.name or "")
    except ValueError as err:
        raise ValueError(f"{entry.name_field}: {err}") from None


def score_functions(
    functions: list[RewardFunction],
    inputs: list[RewardInput],
    batch_size: int,
    timeout: float | None = None,
    name: Callable[[int], str] | None = None,
) -> WeightedScores:
    """Every function on every input (a batched one `batch_size` inputs per call), weighted and summed.
    Each call has `timeout` seconds; `name(i)` names input i (its prompt row) in a timeout's message."""
    n = len(inputs)
    name = name or (lambda i: f"sample {i} of the call")
    out = WeightedScores(np.zeros(n), {}, [None] * n)
    failed: list[list[str]] = [[] for _ in range(n)]
    for f in functions:
        step = batch_size if FORMS[f.form].batched else max(n, 1)
        results = []
        for k in range(0, n, step):
            try:
                results += call_form(f.fn, FORMS[f.form], inputs[k : k + step], timeout)
            except Hung as hung:
                where = "; ".join(name(k + i) for i in hung.positions)
                raise RewardFunctionTimeout(
                    f"reward function {f.name!r} did not return within {hung.timeout:g} s "
                    f"(reward.function_timeout_s) on {where}: the run stops, since a hung call cannot be "
                    "interrupted; make the function return (or raise) on that row, or raise "
                    "reward.function_timeout_s"
                ) from None
        values = np.full(n, np.nan)
        for i, r in enumerate(results):
            problem = r.why if isinstance(r, Failed) else score_problem(r)
            if problem is None:
                values[i] = float(r)
            else:
                failed[i].append(f"reward function {f.name!r} {problem}")
        out.values[f.name] = values
        out.failed[f.name] = np.isnan(values)
        out.total += f.weight * values
    for i, messages in enumerate(failed):
        if messages:
            out.total[i] = np.nan
            out.errors[i] = "; ".join(messages)
    return out
