"""The `data` section of the run schema: prompt files and columns, chat templates and their keyword
arguments, tools, prompt lengths, and dynamic sampling (`data.dynamic_sampling`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cluster.config.filters import FILTERS, check_filter_spec
from cluster.config.sections import _Strict


class DynamicSamplingSection(_Strict):
    filter: str = Field(
        "none",
        description="Which groups (the rollout.sampling.n samples of one prompt) are trained: "
        f"{FILTERS.describe()}; or a user function 'package.module:function' / 'path/to/file.py:function' taking "
        "the group's successful "
        "rewards (a float64 array) and returning whether to keep it. A sample's reward is its return (a multi-turn "
        "episode's outcome plus its earlier turns' rewards with reward.kind='environment'), what grpo and rloo "
        "train on. Dropped groups are counted and the batch is refilled with more prompts; needs "
        "rollout.sampling.n >= 2.",
    )
    max_rounds: int = Field(
        8,
        ge=1,
        description="Sync: collect rounds per step (the first batch + refills of exactly the missing groups); "
        "async: a batch is taken short once the groups scored since the previous one (kept + filtered) reach "
        "max_rounds x data.prompts_per_step. Past it the step trains the informative groups it has (the rest "
        "counted in dynamic/shortfall_groups); with none at all the run stops with an error naming this field.",
    )
    std_eps: float = Field(
        1e-6, ge=0, description="'nonzero_std' keeps a group whose rewards' population std is > this."
    )

    @field_validator("filter")
    @classmethod
    def _known_filter(cls, spec: str) -> str:
        return check_filter_spec(spec)

    @property
    def enabled(self) -> bool:
        return self.filter != "none"


CHAT_TEMPLATE_KEYWORDS = ("auto", "none")  # data.chat_template's values that are not a Jinja file
# apply_chat_template arguments the data loader sets itself: data.chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
)


class DataSection(_Strict):
    prompts_path: str | list[str] = Field(
        ...,
        description="The prompts: a file (.jsonl: one object per line; .json: a list of objects; .parquet; "
        ".csv: a header line, every value a string), a folder saved by datasets' save_to_disk, a glob of them "
        "(sorted), or a list of any of these, read in order and concatenated. Each row's identity is its position in that concatenation (a JSONL file's "
        "line number, blank lines included). See docs/data.md.",
    )
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or a list of chat messages ({role: system|user|"
        "assistant|tool, content: string, optional tool_calls}) rendered with data.chat_template; a string "
        "holding such a list as JSON text (a CSV cell, an export's string column) is read as those messages "
        "and counted. Every other "
        "column of the row is the prompt's meta (handed to rule/remote rewards and environments).",
    )
    meta_keys: list[str] = Field(
        default_factory=list,
        description="Columns every row must have (checked when the prompts are read; a row without one is an "
        "error). Every column besides data.prompt_key reaches the reward as meta whether listed or not.",
    )
    prompts_per_step: int = Field(
        64, ge=1, description="Prompts per PPO iteration (rollout batch = this x sampling.n)."
    )
    max_prompt_tokens: int = Field(
        64,
        ge=1,
        description="Longest prompt in tokens, counted as the model sees it (BOS and, for chat prompts, the "
        "whole rendered template: system prompt, role markers and the generation prompt). It also sizes the "
        "engines' context (+ rollout.sampling.max_new_tokens): chat prompts usually need hundreds; "
        "`python -m cluster.data CONFIG` prints the lengths.",
    )
    long_prompt: Literal["truncate", "skip"] = Field(
        "truncate",
        description="Over-long plain-text prompts: keep the last tokens, or skip them (counted). Over-long "
        "chat prompts are always skipped and counted (never cut through the template).",
    )
    add_bos: bool = Field(
        True,
        description="Prepend the tokenizer's BOS token to plain-text prompts when it has one. Never added to a "
        "rendered chat prompt: its ids are the template's (a template that wants a BOS writes {{ bos_token }}).",
    )
    chat_template: str = Field(
        "auto",
        description="How chat-message prompts become tokens: 'auto' (the tokenizer's own chat template; a "
        "messages prompt with a tokenizer that has none is an error), 'none' (messages prompts are an error), "
        "or a path to a Jinja file used instead of the tokenizer's. Rendered with add_generation_prompt=True.",
    )
    system_prompt: str | None = Field(
        None, description="A system message put first in every chat prompt whose messages have none."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template (apply_chat_template's keyword arguments), e.g. "
        "{enable_thinking: false}.",
    )
    tools: list[str | dict[str, Any]] = Field(
        default_factory=list,
        description="Tools the chat template writes into the prompt (apply_chat_template's tools=), each "
        "'file.py:function' (a path from the current directory) or 'dotted.module:function' naming a typed "
        "Python function with a Google-style docstring (transformers' get_json_schema writes its JSON "
        "schema), or a schema given as is ({type: function, function: {name, description, parameters}}). "
        "Prompts and chat observations get the same schemas. See docs/data.md.",
    )
    wrap_string_prompts: bool = Field(
        False,
        description="A string prompt becomes one user message rendered with the chat template (instead of "
        "plain text).",
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded).")
    dynamic_sampling: DynamicSamplingSection = Field(
        default_factory=DynamicSamplingSection,
        description="Drop groups whose rewards carry no signal and refill the batch with more prompts "
        "(off by default: filter='none').",
    )

    @field_validator("prompts_path")
    @classmethod
    def _some_path(cls, value: str | list[str]) -> str | list[str]:
        paths = [value] if isinstance(value, str) else value
        if not paths or any(not p.strip() for p in paths):
            raise ValueError(
                "give a file, folder or glob (or a non-empty list of them); empty paths are not allowed"
            )
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
        if taken:
            raise ValueError(
                f"{', '.join(taken)} set by the data loader (a prompt is rendered with add_generation_prompt=True, "
                "tokenize=True); keys allowed are the template's own variables, e.g. enable_thinking"
            )
        return kwargs

    @field_validator("tools")
    @classmethod
    def _tool_entries(cls, entries: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        for i, entry in enumerate(entries):
            if isinstance(entry, str):
                source, _, name = entry.rpartition(":")
                if not source.strip() or not name.strip():
                    raise ValueError(
                        f"[{i}] {entry!r}: give 'path/to/file.py:function' or 'dotted.module:function'"
                    )
            else:
                function = entry.get("function")
                if entry.get("type") != "function" or not (
                    isinstance(function, dict) and isinstance(function.get("name"), str)
                ):
                    raise ValueError(
                        f"[{i}]: a schema is {{type: function, function: {{name, description, parameters}}}}, "
                        f"got keys {sorted(entry)}"
                    )
        return entries

    @field_validator("chat_template")
    @classmethod
    def _template_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(f"give one of {', '.join(CHAT_TEMPLATE_KEYWORDS)} or a path to a Jinja file")
        return value

    @model_validator(mode="after")
    def _tools_given_once(self) -> DataSection:
        if self.tools and "tools" in self.chat_template_kwargs:
            raise ValueError(
                "data.tools and data.chat_template_kwargs.tools both give the template's tools: keep one "
                "(data.tools takes functions and schemas)"
            )
        return self

    @model_validator(mode="after")
    def _chat_fields_need_a_template(self) -> DataSection:
        if self.chat_template != "none":
            return self
        used = [
            name
            for name, on in (
                ("data.system_prompt", self.system_prompt is not None),
                ("data.chat_template_kwargs", bool(self.chat_template_kwargs)),
                ("data.tools", bool(self.tools)),
                ("data.wrap_string_prompts", self.wrap_string_prompts),
            )
            if on
        ]
        if used:
            raise ValueError(
                f"{', '.join(used)} apply to chat prompts, which data.chat_template='none' refuses: set "
                "data.chat_template to 'auto' or a Jinja file, or remove them"
            )
        return self

    @property
    def chat_template_file(self) -> str | None:
        """The Jinja file of data.chat_template, None for 'auto' and 'none'."""
        return None if self.chat_template in CHAT_TEMPLATE_KEYWORDS else self.chat_template
