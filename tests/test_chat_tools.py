"""`data.tools`: a typed, documented Python function named as `file.py:function` or `module:function`
becomes its `get_json_schema` schema, and a prompt is rendered exactly as `apply_chat_template(messages,
tools=[schema])` renders it (Qwen2.5's template writes the tools into the system prompt); a schema given
as a dict passes as is; the rollout workers get the same schemas as plain JSON; every bad entry is a
ConfigError naming data.tools and the entry. No Ray, no model: a word-level tokenizer."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from chat_tokenizers import QWEN25_DEFAULT_SYSTEM, QWEN25_SPECIALS, QWEN25_TEMPLATE, chat_tokenizer
from data_files import write_jsonl
from transformers.utils import get_json_schema

from cluster.config.schema import ConfigError, DataSection, build_config
from cluster.prompts.chat import chat_template, template_kwargs
from cluster.prompts.loader import load_prompts

TOOLS_PY = '''
FACTORS = {("km", "m"): 1000, ("h", "min"): 60}


def convert(value: int, unit: str, to: str = "m") -> str:
    """Convert an amount between units.

    Args:
        value: The amount.
        unit: Its unit (choices: ["km", "h"])
        to: The unit to convert to.
    """
    return str(value * FACTORS[unit, to])


def untyped(value, unit: str) -> str:
    """Has a parameter without a type hint.

    Args:
        value: The amount.
        unit: Its unit.
    """


def undocumented(value: int, unit: str) -> str:
    """Describes one of its two parameters.

    Args:
        value: The amount.
    """


NOT_A_FUNCTION = 3
'''
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
QUESTION = "What is 3 km in m ?"
MESSAGES = [{"role": "user", "content": QUESTION}]


def qwen(text: str = ""):
    """Qwen2.5's template over the words of the question (and of `text`: a rendering to decode)."""
    words = [QUESTION, QWEN25_DEFAULT_SYSTEM, "system user assistant", text]
    return chat_tokenizer(words, QWEN25_SPECIALS, QWEN25_TEMPLATE, eos="<|im_end|>")


def tools_file(folder: Path, name: str = "tools.py") -> Path:
    path = folder / name
    path.write_text(TOOLS_PY)
    return path


def function_of(path: Path, name: str):
    """The function as the user wrote it, imported on its own (not through data.tools)."""
    spec = importlib.util.spec_from_file_location(f"test_tools_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def section(tmp_path: Path, **fields) -> DataSection:
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": MESSAGES, "answer": "3000"}])
    return DataSection(prompts_path=str(prompts), max_prompt_tokens=512, **fields)


def reference(tok, tools) -> tuple[str, list[int]]:
    common = {"add_generation_prompt": True, "tools": tools}
    text = tok.apply_chat_template(MESSAGES, tokenize=False, **common)
    ids = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, **common)["input_ids"]
    return text, list(ids)


def test_a_function_entry_renders_the_prompt_as_apply_chat_template_with_its_schema(tmp_path, monkeypatch):
    tok, path = qwen(), tools_file(tmp_path)
    schema = get_json_schema(function_of(path, "convert"))
    assert schema["function"]["parameters"]["properties"]["unit"]["enum"] == ["km", "h"]
    text, ids = reference(tok, [schema])
    assert "<tools>" in text and '"name": "convert"' in text  # the template wrote the tool block
    monkeypatch.chdir(tmp_path)
    for entry in (f"{path}:convert", "tools.py:convert"):  # absolute, and from the current directory
        prompts, _ = load_prompts(section(tmp_path, tools=[entry]), tok)
        assert prompts[0].text == text and prompts[0].ids.tolist() == ids, entry
    assert load_prompts(section(tmp_path), tok)[0][0].text != text  # no tools: no tool block


def test_a_dotted_module_entry_and_a_schema_given_as_is(tmp_path, monkeypatch):
    tok = qwen()
    tools_file(tmp_path, "rayppo_test_tool_module.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = section(tmp_path, tools=["rayppo_test_tool_module:convert", SEARCH])
    kwargs = template_kwargs(cfg)
    assert kwargs["tools"][1] == SEARCH
    assert kwargs["tools"][0] == get_json_schema(
        function_of(tmp_path / "rayppo_test_tool_module.py", "convert")
    )
    prompts, _ = load_prompts(cfg, tok)
    assert (prompts[0].text, prompts[0].ids.tolist()) == reference(tok, kwargs["tools"])
    cfg = section(tmp_path, tools=[SEARCH], chat_template_kwargs={"enable_thinking": False})
    assert template_kwargs(cfg) == {"enable_thinking": False, "tools": [SEARCH]}
    assert chat_template(cfg, tok).kwargs == template_kwargs(cfg)


@pytest.mark.parametrize(
    "entry, why",
    [
        (
            "missing.py:convert",
            r"file 'missing.py' not found \(a relative path is taken from the current directory",
        ),
        ("tools.py:nope", r"tools.py has no function 'nope'"),
        ("tools.py:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is a int, not a function"),
        ("tools.py:untyped", r"get_json_schema cannot describe it: Argument value is missing a type hint"),
        (
            "tools.py:undocumented",
            r"get_json_schema cannot describe it: .*no description for the argument 'unit'",
        ),
        ("rayppo_no_such_module:convert", r"cannot import module 'rayppo_no_such_module'"),
    ],
)
def test_each_bad_entry_is_a_config_error_naming_data_tools_the_entry_and_why(
    tmp_path, monkeypatch, entry, why
):
    tools_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = section(tmp_path, tools=[SEARCH, entry])
    with pytest.raises(ConfigError) as err:
        load_prompts(cfg, qwen())  # what a run and `python -m cluster.data` do first
    assert str(err.value).startswith(f"data.tools[1] {entry!r}: "), str(err.value)
    assert re.search(why, str(err.value)), str(err.value)


def test_two_tools_of_one_name_are_refused(tmp_path):
    path = tools_file(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"data.tools\[1\] .*: a second tool named 'convert' \(the first is data.tools\[0\]\)",
    ):
        template_kwargs(section(tmp_path, tools=[f"{path}:convert", f"{path}:convert"]))


def run_tree(**data) -> dict:
    return {
        "model": {"policy_path": "p"},
        "reward": {"kind": "rule", "rule": "exact_match"},
        "data": {"prompts_path": "x.jsonl", **data},
    }


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"tools": ["t.py:f"], "chat_template_kwargs": {"tools": [SEARCH]}},
            r"data.tools and data.chat_template_kwargs.tools both give the template's tools",
        ),
        ({"tools": ["t.py:f"], "chat_template": "none"}, r"data.tools apply to chat prompts, which .*'none'"),
        ({"tools": ["t.py"]}, r"data.tools: .*\[0\] 't.py': give 'path/to/file.py:function'"),
        ({"tools": [{"name": "f"}]}, r"data.tools: .*\[0\]: a schema is \{type: function, function:"),
    ],
)
def test_the_config_refuses_what_cannot_be_tools(data, message):
    with pytest.raises(ConfigError, match=message):
        build_config(run_tree(**data))


def test_the_workers_get_the_schemas_as_plain_json(tmp_path, monkeypatch):
    """Chat observations are rendered with the prompts' template and the same schemas, which travel as
    data: the workers never import the tools' file."""
    from cluster.placement.rollout_gpus import worker_config
    from rollout_workers.chat_turns import chat_observations

    path = tools_file(tmp_path)
    tree = run_tree(tools=[f"{path}:convert", SEARCH], chat_template_kwargs={"x": 1})
    tree["reward"] = {"kind": "environment"}
    env = {"name": "test-echo", "max_total_tokens": 200, "observation_format": "chat"}
    cfg = build_config({**tree, "rollout": {"environment": env}})
    kwargs = worker_config(cfg).environment.chat_template_kwargs
    assert kwargs == {"x": 1, "tools": [get_json_schema(function_of(path, "convert")), SEARCH]}
    assert json.loads(json.dumps(kwargs)) == kwargs
    path.unlink()  # the schemas are already in the worker's config
    tok = qwen()
    render = chat_observations(
        tok, "tool", {tok.convert_tokens_to_ids("<|im_end|>")}, kwargs={"tools": kwargs["tools"]}
    )
    assert render.kwargs["tools"] == kwargs["tools"]
    text = build_config({**tree, "rollout": {"environment": {**env, "observation_format": "text"}}})
    assert worker_config(text).environment.chat_template_kwargs == {}


def test_the_preview_shows_the_tool_block_and_exits_2_on_a_bad_entry(tmp_path, monkeypatch, capsys):
    from cluster.data import main

    path = tools_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    shown, _ = reference(qwen(), [get_json_schema(function_of(path, "convert"))])
    qwen(shown).save_pretrained(tmp_path / "tok")  # knows the tool block's words: decoded without <unk>
    tree = run_tree(tools=["tools.py:convert"], max_prompt_tokens=512)
    tree["model"]["policy_path"] = str(tmp_path / "tok")
    tree["data"]["prompts_path"] = str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": MESSAGES}]))
    for entry, code in (("tools.py:convert", 0), ("tools.py:untyped", 2)):
        tree["data"]["tools"] = [entry]
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
        assert main([str(tmp_path / "run.yaml"), "-n", "1"]) == code
    shown = capsys.readouterr()
    assert "tools the template is given: convert" in shown.out
    assert "<tools>" in shown.out and '"name": "convert"' in shown.out
    assert "error: data.tools[0] 'tools.py:untyped': get_json_schema cannot describe it" in shown.err


def test_the_documented_chat_math_tools_come_from_its_environment_file(tmp_path, monkeypatch):
    """docs/environments.md's chat model example: its `data.tools` names the functions of its
    chat_envs.py, which describe themselves; the driver importing that file for the tools and the
    environment module run from it again register one environment, not two conflicting ones."""
    from rollout_workers import environment, environments

    monkeypatch.setattr(
        environment.ENVIRONMENTS, "_parts", dict(environment.ENVIRONMENTS._parts)
    )  # chat-math stays here
    page = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    section_md = page.split("### A chat model with two tools", 1)[1]
    (tmp_path / "chat_envs.py").write_text(
        section_md.split("```python\n# chat_envs.py\n", 1)[1].split("```", 1)[0]
    )
    config = yaml.safe_load(section_md.split("```yaml\n", 1)[1].split("```", 1)[0])
    monkeypatch.chdir(tmp_path)
    data = section(tmp_path, **config["data"])
    tools = template_kwargs(data)["tools"]
    assert [t["function"]["name"] for t in tools] == ["calculator", "convert"]
    assert tools[0]["function"]["parameters"]["required"] == ["expression"]
    assert tools[1]["function"]["parameters"]["properties"]["unit"]["enum"] == ["km", "h", "kg"]
    assert all(t["function"]["description"] for t in tools)
    env = environments.make_environment("chat-math", config["rollout"]["environment"]["module"])
    call = '<tool_call>{"name": "convert", "arguments": {"value": "3", "unit": "km", "to": "m"}}</tool_call>'
    step = environment.as_step(env.step(call, env.reset("q", {"answer": 3000})))
    assert step.observation == [{"role": "tool", "content": "3000"}]
    (tmp_path / "other_envs.py").write_text((tmp_path / "chat_envs.py").read_text())
    with pytest.raises(ValueError, match="'chat-math' is already registered"):  # another file's: a conflict
        environments.make_environment("chat-math", "other_envs.py")
