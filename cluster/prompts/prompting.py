"""How a run prompted its model, carried into a model folder it writes (`final/`, `cluster.export`).

A run renders chat prompts with a template (`data.chat_template`: the tokenizer's own, or a Jinja file),
`data.chat_template_kwargs` and `data.system_prompt` (`cluster.prompts.chat`). A served model is prompted
by the folder's tokenizer alone, so the folder carries all three:

- the template is the tokenizer's chat template (a Jinja file's text written into it);
- where the template allows it, the kwargs and the system prompt become the template's defaults: it is
  prefixed with `{% if k is not defined %}{% set k = v %}{% endif %}` per kwarg and a system message put
  first when the messages hold none, so `apply_chat_template(messages)` with no kwargs renders what the
  run rendered (a caller's own kwargs and system message still win). The prefixed template is kept only
  when it renders the probe conversations (`PROBES`) exactly as the run did; otherwise the template is
  kept as it is, and the record says why;
- always, `prompting.json` (`PROMPTING_FILE`) records the template's source, the kwargs, the system
  prompt, `data.tools` as configured (the template is not given them by default: pass the same schemas
  as `tools=` when serving) and whether the defaults are in the template.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cluster.config.schema import DataSection
from cluster.prompts.chat import ChatTemplate

PROMPTING_FILE = "prompting.json"
PROBES = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
    [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
    ],
]


@dataclass(frozen=True)
class Prompting:
    """What a model folder records of how the run prompted its model (`prompting.json`)."""

    chat_template: str | None  # where the template came from; None: plain-text prompts only
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    tools: list[Any] = field(default_factory=list)  # data.tools as configured
    defaults_in_template: bool = False  # kwargs and system prompt are the saved template's defaults
    note: str = ""  # why they are not, when there were some to carry


def jinja_literal(value: Any) -> str:
    """`value` (a JSON value) as a Jinja literal; a TypeError for anything else."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(jinja_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {jinja_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def with_defaults(template: str, kwargs: dict[str, Any], system_prompt: str | None) -> str:
    """`template` prefixed with `kwargs` as defaults of its variables and `system_prompt` as the first
    message of messages that hold no system message (see the module)."""
    prefix = "".join(
        f"{{%- if {k} is not defined %}}{{%- set {k} = {jinja_literal(v)} %}}{{%- endif %}}"
        for k, v in kwargs.items()
    )
    if system_prompt is not None:
        prefix += (
            "{%- if not (messages | selectattr('role', 'equalto', 'system') | list) %}"
            f"{{%- set messages = [{{'role': 'system', 'content': {jinja_literal(system_prompt)}}}] + messages %}}"
            "{%- endif %}"
        )
    return prefix + template


def _renders_as_trained(tokenizer: Any, saved: str, template: str, cfg: DataSection) -> str:
    """'' when `saved` with no kwargs renders every probe as `template` with the run's kwargs and system
    prompt; otherwise what differs."""
    run = ChatTemplate(template, "", cfg.system_prompt, dict(cfg.chat_template_kwargs))
    for probe in PROBES:
        try:
            want = tokenizer.apply_chat_template(
                run.conversation(probe), chat_template=template, tokenize=False, add_generation_prompt=True,
                **run.kwargs,
            )  # fmt: skip
            got = tokenizer.apply_chat_template(
                probe, chat_template=saved, tokenize=False, add_generation_prompt=True
            )
        except Exception as err:  # noqa: BLE001 - a template's own error: keep the template as it is
            return f"rendering {probe} fails: {type(err).__name__}: {err}"
        if got != want:
            return f"with them as defaults the template renders {probe} as {got!r}, not as the run did ({want!r})"
    return ""


def _with_defaults_if_exact(tokenizer: Any, template: Any, cfg: DataSection) -> tuple[Any, str]:
    """The template to save and why the run's kwargs and system prompt are not its defaults ('' when they
    are): `with_defaults` where the template is one Jinja text, the kwargs are names and JSON values, and
    the result renders the probes as the run did (`_renders_as_trained`); the template as it is otherwise."""
    if not isinstance(template, str):
        return template, "the tokenizer has no single chat template to carry them: pass them when serving"
    if any(not k.isidentifier() for k in cfg.chat_template_kwargs):
        return template, "a kwarg's name is not a template variable name: pass them when serving"
    try:
        saved = with_defaults(template, cfg.chat_template_kwargs, cfg.system_prompt)
    except TypeError as err:
        return template, f"a kwarg is not a JSON value ({err}): pass them when serving"
    note = _renders_as_trained(tokenizer, saved, template, cfg)
    return (template, note) if note else (saved, "")


def save_tokenizer(cfg: DataSection, tokenizer_path: str, out: str | Path) -> Prompting:
    """The run's tokenizer into the model folder `out`, carrying how the run prompted (see the module):
    its template (a `data.chat_template` Jinja file's text written into it), the kwargs and system prompt
    as the template's defaults where it allows, and `prompting.json`. Returns what the file records."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if cfg.chat_template_file:
        template = Path(cfg.chat_template_file).expanduser().read_text(encoding="utf-8")
        source = cfg.chat_template_file
    else:
        template = getattr(tokenizer, "chat_template", None)
        source = "the tokenizer's own" if template else None
    wanted = bool(cfg.chat_template_kwargs) or cfg.system_prompt is not None
    template, note = _with_defaults_if_exact(tokenizer, template, cfg) if wanted else (template, "")
    if isinstance(template, str):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    record = Prompting(
        source,
        dict(cfg.chat_template_kwargs),
        cfg.system_prompt,
        list(cfg.tools),
        defaults_in_template=wanted and not note,
        note=note,
    )
    (Path(out) / PROMPTING_FILE).write_text(json.dumps(asdict(record), indent=1, default=str))
    return record
