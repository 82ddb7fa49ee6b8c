"""Observations of a multi-turn episode rendered by the policy's chat template, appended token-wise.

An episode's ids only grow (`rollout_workers.episodes`): the model's turns stay exactly as sampled, so
an observation cannot be rendered by re-rendering the whole conversation. What the template writes
between the end of an assistant message and the start of the next assistant turn is found once, on a
fixed reference conversation:

    base = render([user, assistant], add_generation_prompt=False)
    full = render([user, assistant, {role: observation_role, content: obs}], add_generation_prompt=True)

The template must preserve the prefix (`full` starts with `base`, as ChatML's and Llama 3's do) and
write the same continuation whatever came before; both are checked when the renderer is built on a few
conversations (with a system message, after several turns, after an assistant turn holding a
`<think>` block): a template that rewrites earlier turns when a message is added (e.g. Qwen3's, which
drops past reasoning) cannot be continued token-wise and is refused, saying after what it differs. An
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
# Conversations the continuation must not depend on: with a system message, after several turns, and
# after an assistant turn holding a reasoning block (templates that drop past reasoning fail here).
_CHECKS = [
    [{"role": "system", "content": "be brief"}, *_BASE],
    [*_BASE, {"role": "user", "content": "again"}, {"role": "assistant", "content": "hi again"}],
    [_BASE[0], {"role": "assistant", "content": "<think> hmm </think> hi"}],
]


def _ids(tokenizer: Any, messages: list[dict], generation: bool, kwargs: dict) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation, return_dict=True, **kwargs
    )
    return [int(t) for t in out["input_ids"]]


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
        full = _ids(self.tokenizer, [*_BASE, *messages], True, self.kwargs)
        return ids + list(self.tail) + full[self.base_len :]


def chat_observations(
    tokenizer: Any, role: str, stops: Collection[int], template: str | None = None, kwargs: dict | None = None
) -> ChatObservations:
    """The renderer for `tokenizer`'s chat template (or `template`, a Jinja string); ValueError when the
    template has none, does not preserve the prefix, or ends turns on a token the engine does not stop at."""
    kwargs = dict(kwargs or {})
    if template is not None:
        kwargs["chat_template"] = template
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "rollout.environment.observation_format='chat': the policy's tokenizer has no chat template"
        )
    base = _ids(tokenizer, _BASE, False, kwargs)
    observation = {"role": role, "content": _MARK}
    continuation = None
    for conversation in [_BASE, *_CHECKS]:
        before = _ids(tokenizer, conversation, False, kwargs)
        full = _ids(tokenizer, [*conversation, observation], True, kwargs)
        shown = " / ".join(f"{m['role']}: {m['content']}" for m in conversation)
        if full[: len(before)] != before:
            raise ValueError(
                "rollout.environment.observation_format='chat': the chat template does not preserve the "
                f"prefix: rendering a {role!r} message after [{shown}] changes the tokens before it, so "
                "observations cannot be appended token-wise; use observation_format='text'"
            )
        if continuation is not None and full[len(before) :] != continuation:
            raise ValueError(
                "rollout.environment.observation_format='chat': the chat template renders a "
                f"{role!r} message differently after [{shown}] than after a plain exchange, so the "
                "continuation depends on earlier turns; use observation_format='text'"
            )
        continuation = full[len(before) :]
    ends = [i for i, t in enumerate(base) if t in stops]
    if not ends:
        special = [tokenizer.convert_ids_to_tokens(t) for t in base if t in tokenizer.all_special_ids]
        raise ValueError(
            "rollout.environment.observation_format='chat': an assistant message of the chat template ends "
            f"with none of the tokens the engine stops at (the template's special tokens: {special}); add "
            "its end-of-turn token to rollout.environment.stop_strings"
        )
    last = ends[-1]
    return ChatObservations(tokenizer, role, base[last], tuple(base[last + 1 :]), kwargs, len(base))
