"""The forms a reward function may take, told apart in this one place, and how each is called.

| form      | signature                                                   | how it is known                      |
|-----------|-------------------------------------------------------------|--------------------------------------|
| `rule`    | `fn(prompt, response, meta) -> float`                       | three required positional parameters |
| `record`  | `fn(x: RewardInput) -> float`                               | `@reward_function(batched=False)`    |
| `batched` | `fn(xs: list[RewardInput]) -> list[float]`                  | `@reward_function(batched=True)`     |
| `verl`    | `compute_score(data_source, solution_str, ground_truth, extra_info) -> float or {'score': ...}` | those parameter names |

A config's `style` names the form outright (a function that cannot be decorated). Any form may be an
`async def`: whatever a call returns that is awaitable is awaited, a batched call's once, the per-sample
calls' together (`asyncio.gather`). A call that raises, or a batched result that is no list of one entry
per input, is a `Failed` entry for each sample it was meant for; the values themselves are checked by
the caller (`reward_service.values`).

Every call has a deadline (`timeout`, reward.function_timeout_s): it runs in a helper thread, and a call
that has not returned by then raises `Hung` naming the inputs it was meant for (a hung thread cannot be
stopped, so the caller stops: the scorer's error names the function, the row and the timeout).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernel.registry import Part, Registry
from reward_service.functions import FORM_ATTRIBUTE, RewardInput
from reward_service.verl_style import PARAMETERS as VERL_PARAMETERS
from reward_service.verl_style import verl_call, verl_score


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, kw_only=True)
class Form(Part):
    """How to call one form: `function` (fn, a RewardInput or a list of them) -> result or awaitable, per
    sample or per batch (`batched`), and what of one sample's result is the score (`score`)."""

    batched: bool = False
    score: Callable[[Any], Any] = _same


# The forms by name: reward.functions[].style's allowed values (besides 'auto') and their reference text.
FORMS: Registry[Form] = Registry(
    "reward function style",
    "reward.functions[].style",
    [
        Form(
            name="rule",
            function=lambda fn, x: fn(x.prompt, x.response, x.meta),
            summary="fn(prompt, response, meta)",
        ),
        Form(name="record", function=lambda fn, x: fn(x), summary="fn(RewardInput)"),
        Form(
            name="batched",
            function=lambda fn, xs: fn(xs),
            batched=True,
            summary="fn(list[RewardInput]) -> list",
        ),
        Form(
            name="verl",
            function=verl_call,
            score=verl_score,
            summary="compute_score(data_source, solution_str, ground_truth, extra_info)",
        ),
    ],
)


@dataclass(frozen=True)
class Failed:
    """A sample a function gave no result for; `why` follows the function's name in the message."""

    why: str


class Hung(Exception):
    """A call did not return within `timeout` seconds; `positions` are the inputs it was meant for."""

    def __init__(self, positions: list[int], timeout: float) -> None:
        super().__init__(f"no result within {timeout:g} s for inputs {positions}")
        self.positions, self.timeout = positions, timeout


def each_within(
    timeout: float | None, thunks: list[Callable[[], Any]]
) -> list[tuple[Any, BaseException | None]]:
    """Each thunk's outcome, `(value, None)` or `(None, the exception it raised)`, the thunks called one
    after the other in ONE daemon helper thread (a thread per call cost ~0.1 ms a sample, 100x the call
    of a simple rule); `Hung([k])` when thunk k has not returned `timeout` seconds after it started.
    None: called right here, without a deadline."""
    out: list[tuple[Any, BaseException | None]] = [(None, None)] * len(thunks)
    if timeout is None:
        for k, thunk in enumerate(thunks):
            out[k] = _outcome(thunk)
        return out
    lock = threading.Lock()
    current = [0, time.monotonic()]  # the call running now, and since when
    done = threading.Event()

    def run() -> None:
        for k, thunk in enumerate(thunks):
            with lock:
                current[:] = [k, time.monotonic()]
            out[k] = _outcome(thunk)
        done.set()

    threading.Thread(target=run, name="reward-function", daemon=True).start()
    while True:
        with lock:
            k, since = current
        if done.wait(max(0.0, since + timeout - time.monotonic())):
            return out
        with lock:
            if current[0] == k and time.monotonic() - current[1] >= timeout:
                raise Hung([k], timeout)


def _outcome(thunk: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return thunk(), None
    except BaseException as e:  # handed to the caller as it is
        return None, e


def within(timeout: float | None, thunk: Callable[[], Any], positions: list[int]) -> Any:
    """thunk()'s value (its exception re-raised), with `timeout` seconds (`each_within`); `Hung(positions)`
    past them."""
    try:
        [(value, error)] = each_within(timeout, [thunk])
    except Hung as hung:
        raise Hung(positions, hung.timeout) from None
    if error is not None:
        raise error
    return value


def detect_form(fn: Callable, style: str, field: str) -> str:
    """The form of `fn`: `style` when it names one (it must agree with a `@reward_function` mark), else
    the mark, else the verl parameter names, else the legacy three-argument rule. ValueError naming
    `field` when none fits."""
    declared = getattr(fn, FORM_ATTRIBUTE, None)
    if style != "auto":
        if style not in FORMS:
            raise ValueError(f"{field}: unknown style {style!r}; known: auto, {', '.join(FORMS.names())}")
        if declared is not None and declared != style:
            raise ValueError(
                f"{field}: style {style!r}, but the function is marked {declared!r} by @reward_function"
            )
        return style
    if declared is not None:
        return declared
    what = getattr(fn, "__qualname__", repr(fn))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"{field}: cannot read the signature of {what}: set its style") from None
    if set(VERL_PARAMETERS) <= set(sig.parameters):
        return "verl"
    if _binds(sig, 3) and not _binds(sig, 1):
        return "rule"
    raise ValueError(
        f"{field}: cannot tell how to call {what}{sig}: write it as fn(prompt, response, meta), mark it "
        "with @reward_function(batched=False) (one RewardInput) or @reward_function(batched=True) (a list), "
        f"or set its style ({', '.join(FORMS.names())})"
    )


def _binds(sig: inspect.Signature, n: int) -> bool:
    try:
        sig.bind(*range(n))
    except TypeError:
        return False
    return True


def call_form(fn: Callable, form: Form, inputs: list[RewardInput], timeout: float | None = None) -> list[Any]:
    """One result per input: the score as the function gave it (unchecked), or `Failed`. Each call (a
    batched call with its await, one sample's call, the per-sample awaitables together) has `timeout`
    seconds (`within`)."""
    if form.batched:
        return _call_batched(fn, form, inputs, timeout)
    results: list[Any] = []
    pending: dict[int, Any] = {}
    outcomes = each_within(timeout, [lambda x=x: form.function(fn, x) for x in inputs])
    for k, (result, error) in enumerate(outcomes):
        if error is not None:
            if not isinstance(error, Exception):  # not a sample's failure (KeyboardInterrupt, SystemExit)
                raise error
            result = _raised(error)  # one bad sample must not sink the others
        if inspect.isawaitable(result):
            pending[k] = result
        results.append(result)
    if not pending:
        return [r if isinstance(r, Failed) else _score(form, r) for r in results]
    finished: set[int] = set()

    async def tracked(k: int, aw: Any) -> Any:
        value = await aw
        finished.add(k)
        return value

    awaited = [tracked(k, aw) for k, aw in pending.items()]
    try:
        values = within(timeout, lambda: run_awaitables(awaited), list(pending))
    except Hung as hung:
        raise Hung([k for k in pending if k not in finished], hung.timeout) from None
    for k, value in zip(pending, values, strict=True):
        results[k] = value
    return [r if isinstance(r, Failed) else _score(form, r) for r in results]


def _call_batched(fn: Callable, form: Form, inputs: list[RewardInput], timeout: float | None) -> list[Any]:
    n = len(inputs)

    def call() -> Any:
        result = form.function(fn, inputs)
        return run_awaitables([result])[0] if inspect.isawaitable(result) else result

    try:
        result = within(timeout, call, list(range(n)))
    except Hung:
        raise
    except Exception as e:
        return [_raised(e)] * n
    if isinstance(result, Failed):
        return [result] * n
    if isinstance(result, (str, bytes, dict)) or not isinstance(result, (Sequence, np.ndarray)):
        return [Failed(f"returned {type(result).__name__}, not a list of {n} scores")] * n
    if len(result) != n:
        return [Failed(f"returned {len(result)} scores for {n} samples")] * n
    return [_score(form, r) for r in result]


def _score(form: Form, result: Any) -> Any:
    try:
        return form.score(result)
    except Exception as e:
        return _raised(e)


def _raised(e: BaseException) -> Failed:
    return Failed(f"raised {type(e).__name__}: {e}")


def run_awaitables(awaitables: list[Any]) -> list[Any]:
    """Await them together; each one's value, or `Failed` for one that raised. Runs its own event loop
    (in a helper thread when this thread already runs one)."""
    if not awaitables:
        return []

    async def gather() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        values = asyncio.run(gather())
    else:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            values = pool.submit(asyncio.run, gather()).result()
    for v in values:
        if isinstance(v, BaseException) and not isinstance(v, Exception):
            raise v  # KeyboardInterrupt, SystemExit, a cancelled run: not a sample's failure
    return [_raised(v) if isinstance(v, Exception) else v for v in values]
