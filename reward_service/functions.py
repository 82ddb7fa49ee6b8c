"""What a reward function receives, and how it declares its form: the user-facing side of
`reward.functions`.

A function takes one `RewardInput` and returns a score (`@reward_function(batched=False)`), or a list of
them and returns a list of scores, one per input (`@reward_function(batched=True)`); either may be an
`async def`. Undecorated functions in the legacy `fn(prompt, response, meta)` form and verl-style
`compute_score(data_source, solution_str, ground_truth, extra_info)` functions work as they are
(`reward_service.forms` tells the forms apart). A score is a finite real number; a function that cannot
judge a sample raises, and that sample fails (counted, never scored 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

# The attribute `reward_function` sets: the name of the declared form in `reward_service.forms.FORMS`.
FORM_ATTRIBUTE = "__reward_form__"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RewardInput:
    """One sample as a reward function sees it.

    `prompt` is the prompt as the policy got it (a chat prompt's rendered template, special tokens
    included; plain text as written), `messages` the chat messages it was rendered from (None for plain
    text), `response` the response decoded without special tokens and `response_ids` its token ids (a
    multi-turn episode's: every token after the prompt, observations included), `finish_reason` 'stop' or
    'length' (None only when a direct caller of `RewardScorer.score` gave none), `meta` every other column
    of the prompt's row (JSON values; shared by the prompt's samples: read it, do not change it)."""

    prompt: str
    messages: list[dict[str, Any]] | None
    response: str
    response_ids: list[int]
    finish_reason: str | None
    meta: dict[str, Any]


def reward_function(fn: F | None = None, *, batched: bool = False) -> Any:
    """Declare a reward function's form: `batched=False` takes one `RewardInput` and returns a score,
    `batched=True` takes a list of them and returns one score per input, in order. The function itself
    is returned, marked (usable bare, `@reward_function`, for the single form)."""

    def mark(f: F) -> F:
        setattr(f, FORM_ATTRIBUTE, "batched" if batched else "record")
        return f

    return mark if fn is None else mark(fn)
