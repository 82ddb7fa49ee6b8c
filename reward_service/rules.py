"""Rule-based (verifiable) rewards: a registry of plain functions `fn(prompt, response, meta) -> float`.

Users add their own with `@register_reward("name")` in a module named by `reward.rule_module`.
A rule that cannot judge a sample (missing meta, bad input) should raise: the scorer reports the
sample as failed instead of training on a made-up score.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernel.registry import Part, Registry

RewardFn = Callable[[str, str, dict[str, Any]], float]

RULES: Registry[Part] = Registry("reward rule", "reward.rule")  # filled by `@register_reward`
_LOADED_FILES: dict[str, Any] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a rule under `name`; re-importing the same function is harmless."""
    return RULES.register(name)


def list_rewards() -> list[str]:
    return sorted(RULES.names())


def get_reward(name: str, module: str | None = None) -> RewardFn:
    """The rule registered as `name`, after importing `module` (see `load_rule_module`) when given."""
    if module:
        load_rule_module(module)
    return RULES.function(name)


def load_rule_module(spec: str) -> None:
    """Import a dotted module name or a .py file so its `@register_reward` decorators run (once per file)."""
    import_user_module(spec, "reward.rule_module")


def import_user_module(spec: str, field: str) -> Any:
    """The module a user names in the config field `field`: a .py file (imported once per file) or a
    dotted module name. Any failure is a ValueError naming `field`."""
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        key = str(path.resolve())
        if key in _LOADED_FILES:
            return _LOADED_FILES[key]
        if not path.is_file():
            raise ValueError(f"{field}: file {spec!r} does not exist")
        mod_name = f"_rayppo_user_{abs(hash(key))}"
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise ValueError(f"{field}: cannot import file {spec!r}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise ValueError(f"{field}: {spec!r} failed to import: {type(e).__name__}: {e}") from e
        _LOADED_FILES[key] = module
        return module
    try:
        return importlib.import_module(spec)
    except Exception as e:
        raise ValueError(f"{field}: cannot import module {spec!r}: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------- answer extraction and normalisation

_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = text.find("{", start)
        if i != -1 and text[start + len("\\boxed") : i].strip() == "":
            depth, j = 0, i
            while j < len(text):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j]
                j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer(response: str) -> str | None:
    """The final answer of a response: last \\boxed{}, else the text after '####', else the last number."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0]
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def normalize_answer(answer: str) -> str:
    """Canonical form: case, spaces, $, \\text{}, thousands separators and trailing dots removed; numbers as numbers."""
    s = str(answer).strip().lower()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace(" ", "")
    s = s.rstrip(".")
    num = s.replace(",", "")
    try:
        if "/" in num:
            a, b = num.split("/", 1)
            value = float(a) / float(b)
        else:
            value = float(num)
    except (ValueError, ZeroDivisionError):
        return s
    if not math.isfinite(value):
        return s
    return repr(round(value, 9)) if value != int(value) else str(int(value))


def _answer(meta: dict[str, Any]) -> str:
    if "answer" not in meta:
        raise KeyError(f"rule needs meta['answer']; meta has keys {sorted(meta)}")
    return normalize_answer(str(meta["answer"]))


# ---------------------------------------------------------------- shipped rules


@register_reward("exact_match")
def exact_match(prompt: str, response: str, meta: dict[str, Any]) -> float:
    """1.0 when the response's final answer equals meta['answer'] after normalisation, else 0.0."""
    found = extract_answer(response)
    return float(found is not None and normalize_answer(found) == _answer(meta))


_INTEGER = re.compile(r"[-+]?[0-9]+")


@register_reward("exact_integer")
def exact_integer(prompt: str, response: str, meta: dict[str, Any]) -> float:
    """1.0 when the whole response (spaces around it aside) is an integer equal to meta['answer'], else 0.0.

    Stricter than `exact_match`, for answers with no working: "47" scores 1 for 47, while "4 7",
    "12+47", "47.0", "47=" or an empty response score 0 (a malformed answer is wrong, never an error).
    """
    text = response.strip()
    return float(_INTEGER.fullmatch(text) is not None and int(text) == int(_answer(meta)))


@register_reward("format_boxed")
def format_boxed(prompt: str, response: str, meta: dict[str, Any]) -> float:
    """1.0 for a correct \\boxed{} answer, meta['format_score'] (default 0) for a wrong one, 0 with no box."""
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    if normalize_answer(boxed) == _answer(meta):
        return 1.0
    return float(meta.get("format_score", 0.0))


@register_reward("contains_keyword")
def contains_keyword(prompt: str, response: str, meta: dict[str, Any]) -> float:
    """Fraction of meta['keywords'] found in the response as whole words (case-insensitive)."""
    keywords = meta.get("keywords")
    if not keywords or isinstance(keywords, str):
        raise KeyError("rule contains_keyword needs meta['keywords'] as a non-empty list of strings")
    text = response.lower()
    hits = sum(bool(re.search(rf"(?<!\w){re.escape(str(k).lower())}(?!\w)", text)) for k in keywords)
    return hits / len(keywords)


@register_reward("length_penalty")
def length_penalty(prompt: str, response: str, meta: dict[str, Any]) -> float:
    """0 up to meta['max_words'] words, then -(excess words / max_words): discourages rambling."""
    if "max_words" not in meta:
        raise KeyError("rule length_penalty needs meta['max_words']")
    limit = int(meta["max_words"])
    if limit <= 0:
        raise ValueError(f"meta['max_words'] must be > 0, got {limit}")
    return -max(0, len(response.split()) - limit) / limit
