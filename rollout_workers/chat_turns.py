"""Observations of a multi-turn episode rendered by the policy's chat template, appended token-wise.

An episode's ids only grow (`rollout_workers.episodes`): the model's turns stay exactly as sampled, so
an observation cannot be rendered by re-rendering the whole conversation. What the template writes
between the end of an assistant message and the start of the next assistant turn is found once, on a
fixed reference conversation:

    base = render([user, assistant], add_generation_prompt=False)
    full = render([user, assistant, {role: observation_role, content: obs}], add_generation_prompt=True)

The template must preserve the prefix (`full` starts with `base`, as ChatML's and Llama 3's do), write
the same continuation whatever came before, and write each earlier assistant message's content as it
is; all three are checked when the renderer is built (`check_chat_template`, which the cluster also
runs before any actor starts) on a few conversations (with a system message, after several turns,
after an assistant turn holding a `<think>` block): a template that rewrites earlier turns when a
message is added (Qwen3's with `user` observations, which drops past reasoning before the last user
message) or rewrites an assistant turn's content whatever follows (DeepSeek-R1-Distill's, which
keeps only what follows `</think>`) would train on contexts the served model never sees, and is
refused, saying after what it differs; so is one that cannot render a message of `observation_role`
(Gemma 3's refuses `tool`), naming the setting. An
environment may answer a text (one message of `observation_role`) or its own list of messages. An assistant message in
`base` ends with the template's end-of-turn token (the last token of `base` that the engine stops on)
followed by a `tail` the model never samples (ChatML: the newline after `<|im_end|>`). An observation's
ids are then:

    [end-of-turn, if the model's turn did not end with a stop token] + tail + full[len(base):]

with the reference observation replaced by the real one (one render per observation, with the same
kwargs). The end-of-turn token added after a turn cut by its length or by a stop string is an
observation token (loss mask 0): the policy did not sample it. A template whose end-of-turn token is
not one the engine stops at would let a turn run past its end: refused, naming the token.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

_BASE = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
_MARK = "observation"
_FORMAT = "rollout.environment.observation_format='chat'"
# Conversations the continuation must not depend on: with a system message, after several turns, and
# after an assistant turn holding a reasoning block as reasoning models write it (templates that drop
# or rewrite past reasoning fail here).
_CHECKS = [
    [{"role": "system", "content": "be brief"}, *_BASE],
    [*_BASE, {"role": "user", "content": "again"}, {"role": "assistant", "content": "hi again"}],
    [_BASE[0], {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhi"}],
]


def _render(
    tokenizer: Any, messages: list[dict], generation: bool, kwargs: dict, role: str, tokenize: bool = True
):
    """apply_chat_template's ids (or text); a template's own error (raise_exception) is a ValueError
    naming the observation role and the conversation."""
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=tokenize, add_generation_prompt=generation, return_dict=tokenize, **kwargs
        )
    except Exception as err:  # noqa: BLE001 - jinja2's TemplateError and whatever a template raises
        shown = " / ".join(f"{m['role']}: {m['content']}" for m in messages)
        raise ValueError(
            f"{_FORMAT}: the chat template cannot render [{shown}] ({type(err).__name__}: {err}); set "
            f"rollout.environment.observation_role (now {role!r}) to a role the template takes (e.g. 'user'), "
            "or observation_format='text'"
        ) from None
    return [int(t) for t in out["input_ids"]] if tokenize else out


@dataclass(frozen=True)
class ChatObservations:
    """Renders observations as the policy's chat template writes a message of `role` (see the module)."""

    tokenizer: Any
    role: str
    end_of_turn: int
    tail: tuple[int, ...]
    kwargs: dict
    base_len: int

    def __call__(
        self, turn_ids: list[int], observation: str | list[dict], stops: Collection[int]
    ) -> list[int]:
        """The ids to append after a model turn `turn_ids` for `observation` (a text, sent as one message
        of `role`, or the environment's own messages); `stops` are the ids the engine ends a turn on."""
        ids = [] if turn_ids and turn_ids[-1] in stops else [self.end_of_turn]
        messages = (
            [{"role": self.role, "content": observation}] if isinstance(observation, str) else observation
        )
        full = _render(self.tokenizer, [*_BASE, *messages], True, self.kwargs, self.role)
        return ids + list(self.tail) + full[self.base_len :]


def check_chat_template(
    tokenizer: Any, role: str, template: str | None = None, kwargs: dict | None = None
) -> dict:
    """The keyword arguments every rendering takes (`kwargs`, and `template` as chat_template); a
    ValueError when the template has none, cannot render a message of `role`, does not preserve the
    prefix, renders the observation differently after different turns, or rewrites an earlier
    assistant message's content (see the module)."""
    kwargs = dict(kwargs or {})
    if template is not None:
        kwargs["chat_template"] = template
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{_FORMAT}: the policy's tokenizer has no chat template")
    observation = {"role": role, "content": _MARK}
    continuation = None
    for conversation in [_BASE, *_CHECKS]:
        before = _render(tokenizer, conversation, False, kwargs, role)
        full = _render(tokenizer, [*conversation, observation], True, kwargs, role)
        shown = " / ".join(f"{m['role']}: {m['content']}" for m in conversation)
        if full[: len(before)] != before:
            raise ValueError(
                f"{_FORMAT}: the chat template does not preserve the "
                f"prefix: rendering a {role!r} message after [{shown}] changes the tokens before it, so "
                "observations cannot be appended token-wise; use observation_format='text'"
            )
        if continuation is not None and full[len(before) :] != continuation:
            raise ValueError(
                f"{_FORMAT}: the chat template renders a "
                f"{role!r} message differently after [{shown}] than after a plain exchange, so the "
                "continuation depends on earlier turns; use observation_format='text'"
            )
        continuation = full[len(before) :]
        text = _render(tokenizer, [*conversation, observation], True, kwargs, role, tokenize=False)
        rewritten = [
            m["content"] for m in conversation if m["role"] == "assistant" and m["content"] not in text
        ]
        if rewritten:
            raise ValueError(
                f"{_FORMAT}: the chat template rewrites the content of an earlier assistant turn: after "
                f"[{shown}] and a {role!r} message it does not write {rewritten[0]!r} as it is (e.g. it "
                "drops past reasoning), so the episodes trained on would keep what the served model never "
                "sees; use observation_format='text', or a template that keeps assistant turns as written"
            )
    return kwargs


def chat_observations(
    tokenizer: Any, role: str, stops: Collection[int], template: str | None = None, kwargs: dict | None = None
) -> ChatObservations:
    """The renderer for `tokenizer`'s chat template (or `template`, a Jinja string); ValueError when
    `check_chat_template` refuses the template, or it ends turns on a token the engine does not stop at."""
    kwargs = check_chat_template(tokenizer, role, template, kwargs)
    base = _render(tokenizer, _BASE, False, kwargs, role)
    ends = [i for i, t in enumerate(base) if t in stops]
    if not ends:
        special = [tokenizer.convert_ids_to_tokens(t) for t in base if t in tokenizer.all_special_ids]
        raise ValueError(
            f"{_FORMAT}: an assistant message of the chat template ends "
            f"with none of the tokens the engine stops at (the template's special tokens: {special}); add "
            "its end-of-turn token to rollout.environment.stop_strings"
        )
    last = ends[-1]
    return ChatObservations(tokenizer, role, base[last], tuple(base[last + 1 :]), kwargs, len(base))
