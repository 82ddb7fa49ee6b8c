"""Chat observations appended token-wise equal the template's rendering of the whole conversation
(rollout_workers/chat_turns.py), for ChatML (Qwen2.5) and Llama 3's template; the templates that
cannot be continued token-wise are refused with the reason."""

from __future__ import annotations

import pytest
from chat_tokenizers import (
    LLAMA3_SPECIALS,
    LLAMA3_TEMPLATE,
    QWEN25_DEFAULT_SYSTEM,
    QWEN25_SPECIALS,
    QWEN25_TEMPLATE,
    chat_tokenizer,
)
from engine_contract_shared import ENGINES

from rollout_workers.chat_turns import chat_observations

WORDS = [
    QWEN25_DEFAULT_SYSTEM,
    "what is two plus three <calc> 2+3 </calc> 5 the answer is five hello hi observation",
]
CASES = {  # name -> (tokenizer, the id that ends an assistant turn, observation role)
    "chatml": (
        lambda: chat_tokenizer(WORDS, QWEN25_SPECIALS, QWEN25_TEMPLATE, eos="<|im_end|>"),
        "<|im_end|>",
        "tool",
    ),
    "llama3": (
        lambda: chat_tokenizer(
            WORDS, LLAMA3_SPECIALS, LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>"
        ),
        "<|eot_id|>",
        "user",
    ),
}


def render(tok, messages, generation=True):
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation, return_dict=True)
    return list(out["input_ids"])


@pytest.mark.parametrize("name", CASES)
def test_an_episode_grown_token_wise_is_the_template_rendering_of_the_conversation(name):
    make, end, role = CASES[name]
    tok = make()
    stops = frozenset({tok.convert_tokens_to_ids(end)})
    chat = chat_observations(tok, role, stops)
    user = {"role": "user", "content": "what is two plus three"}
    ids = render(tok, [user])  # the prompt, as data.chat_template renders it
    turns = [("<calc> 2+3 </calc>", "5"), ("the answer is five", None)]
    messages = [user]
    for text, observation in turns:
        turn = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids(end)]  # ended by EOS
        ids += turn
        messages.append({"role": "assistant", "content": text})
        if observation is not None:
            ids += chat(turn, observation, stops)
            messages.append({"role": role, "content": observation})
    assert ids == render(tok, messages, generation=False)


@pytest.mark.parametrize("name", CASES)
def test_a_turn_cut_before_its_end_token_gets_it_as_an_observation_token(name):
    make, end, role = CASES[name]
    tok = make()
    end_id = tok.convert_tokens_to_ids(end)
    chat = chat_observations(tok, role, frozenset({end_id}))
    cut = tok.encode("<calc> 2+3 </calc>", add_special_tokens=False)  # stopped by a stop string, no EOS
    obs = chat(cut, "5", frozenset({end_id}))
    assert obs[0] == end_id
    assert obs[1:] == chat(cut + [end_id], "5", frozenset({end_id}))


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # renders only the last two messages: adding a message changes the tokens before it
    last_two = (
        "{%- for message in messages[-2:] %}{{- '<|im_start|>' + message.role + ' ' + message.content + "
        "'<|im_end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant' }}{%- endif %}"
    )
    tok = chat_tokenizer(WORDS, QWEN25_SPECIALS, last_two, eos="<|im_end|>")
    with pytest.raises(ValueError, match="does not preserve the prefix"):
        chat_observations(tok, "tool", frozenset({tok.convert_tokens_to_ids("<|im_end|>")}))


def test_an_end_token_the_engine_does_not_stop_at_is_refused_by_name():
    tok = chat_tokenizer(WORDS, QWEN25_SPECIALS, QWEN25_TEMPLATE, eos="<|endoftext|>")
    with pytest.raises(ValueError, match=r"none of the tokens the engine stops at .*<\|im_end\|>"):
        chat_observations(tok, "tool", frozenset({tok.convert_tokens_to_ids("<|endoftext|>")}))


def test_no_template_is_refused():
    tok = chat_tokenizer(WORDS, QWEN25_SPECIALS, None, eos="<|im_end|>")
    with pytest.raises(ValueError, match="has no chat template"):
        chat_observations(tok, "tool", frozenset({tok.convert_tokens_to_ids("<|im_end|>")}))


@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
    """A tiny GPT-2 whose tokenizer carries ChatML (Qwen2.5's template; <|im_end|> is its EOS); head
    size 32, the least vLLM's CPU attention takes."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = CASES["chatml"][0]()
    out = tmp_path_factory.mktemp("chat-policy")
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=256, n_embd=64, n_layer=2, n_head=2,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out), tok


@pytest.mark.parametrize("engine", ENGINES)
def test_a_workers_chat_episode_appends_rendered_observations_with_mask_0(chat_policy, engine):
    """On a real worker and engine (both engines): every observation segment is the template's tool
    message for the turn before it (closing that turn when the model did not), with logprob 0 and
    loss mask 0."""
    import numpy as np
    from test_episodes import Echo  # noqa: F401  (registers 'test-echo')

    from rollout_workers.config import EnvironmentConfig, RolloutConfig, SamplingConfig
    from rollout_workers.worker import RolloutWorker

    path, tok = chat_policy
    env = EnvironmentConfig(
        name="test-echo", max_turns=3, max_total_tokens=200, turn_max_new_tokens=4, observation_format="chat"
    )
    worker = RolloutWorker(path, RolloutConfig(engine=engine, environment=env))
    prompt = np.asarray(render(tok, [{"role": "user", "content": "what is two plus three"}]), dtype=np.int64)
    samples = worker.generate([0], [prompt], seed=5, sampling=SamplingConfig(n=2, max_new_tokens=4))
    runner, end = worker._episodes, tok.convert_tokens_to_ids("<|im_end|>")
    seen_chat = 0
    for s in samples:
        e = s.episode
        assert e.turns == 3 and e.status == "done"
        starts = [0]
        for t in e.turn_ends[:-1]:
            turn = s.response_ids[starts[-1] : t + 1].tolist()
            obs = runner.observation_ids(turn, "the movie")
            a = int(t) + 1
            assert s.response_ids[a : a + len(obs)].tolist() == obs
            assert e.loss_mask[a : a + len(obs)].tolist() == [0] * len(obs)
            assert s.logprobs[a : a + len(obs)].tolist() == [0.0] * len(obs)
            assert obs[0] == end or turn[-1] == end  # every assistant turn is closed
            assert tok.convert_tokens_to_ids("<|im_start|>") in obs
            seen_chat += 1
            starts.append(a + len(obs))
    assert seen_chat == 4


def test_the_cluster_sends_workers_the_prompts_template_and_kwargs(tmp_path):
    """A data.chat_template Jinja file travels to the workers as text (they may run on nodes without
    the file), with data.chat_template_kwargs; a text-observation environment gets neither."""
    from cluster.config.schema import build_config
    from cluster.placement.rollout_gpus import worker_config

    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(QWEN25_TEMPLATE)
    env = {"name": "test-echo", "max_total_tokens": 200}
    raw = {
        "model": {"policy_path": "p"},
        "reward": {"kind": "environment"},
        "data": {"prompts_path": "x.jsonl", "chat_template": str(jinja), "chat_template_kwargs": {"x": 1}},
    }
    chat = worker_config(
        build_config({**raw, "rollout": {"environment": {**env, "observation_format": "chat"}}})
    )
    assert chat.environment.chat_template == QWEN25_TEMPLATE
    assert chat.environment.chat_template_kwargs == {"x": 1}
    text = worker_config(build_config({**raw, "rollout": {"environment": env}}))
    assert text.environment.chat_template is None and text.environment.chat_template_kwargs == {}


def test_a_template_that_drops_past_reasoning_is_refused_naming_the_conversation():
    # Qwen3-like: an assistant message that is no longer the last keeps only what follows </think>
    strips = (
        "{%- for message in messages %}{%- set content = message.content %}"
        "{%- if message.role == 'assistant' and not loop.last %}{%- set content = content.split('</think>')[-1] | trim %}"
        "{%- endif %}{{- '<|im_start|>' + message.role + ' ' + content + ' <|im_end|> ' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant ' }}{%- endif %}"
    )
    tok = chat_tokenizer(
        WORDS + ["<think> hmm </think> be brief again"], QWEN25_SPECIALS, strips, eos="<|im_end|>"
    )
    with pytest.raises(
        ValueError, match=r"does not preserve the prefix: .*after \[user: hello / assistant: <think>"
    ):
        chat_observations(tok, "tool", frozenset({tok.convert_tokens_to_ids("<|im_end|>")}))


def test_an_environment_may_answer_several_messages():
    """Two tool results in one observation: ChatML puts consecutive tool messages in one user block; the
    ids appended are still the full rendering's."""
    tok = CASES["chatml"][0]()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = chat_observations(tok, "tool", frozenset({end}))
    user = {"role": "user", "content": "what is two plus three"}
    turn = tok.encode("<calc> 2+3 </calc>", add_special_tokens=False) + [end]
    results = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "five"}]
    ids = render(tok, [user]) + turn + chat(turn, results, frozenset({end}))
    assistant = {"role": "assistant", "content": "<calc> 2+3 </calc>"}
    assert ids == render(tok, [user, assistant, *results], generation=True)


def test_messages_need_the_chat_observation_format():
    from rollout_workers.environment import Step, as_step

    with pytest.raises(TypeError, match="each must be a message"):
        as_step(Step([{"role": "tool"}], None, False))
    with pytest.raises(TypeError, match="not a str or a list of messages"):
        as_step(Step(5, None, False))
    assert as_step(Step([{"role": "tool", "content": "5"}], None, False)).observation[0]["content"] == "5"


def test_the_environment_is_told_how_each_turn_ended(chat_policy):
    """`turn_end` reaches a `step` that takes it (EOS, a stop string kept in the text even when it is a
    special token, or the length limit); a `step` without it is called as before."""
    import numpy as np

    from rollout_workers.config import EnvironmentConfig, RolloutConfig, SamplingConfig
    from rollout_workers.engine import GenerationOutput
    from rollout_workers.environment import Environment, Step, TurnEnd, register_environment, step_with
    from rollout_workers.worker import RolloutWorker

    seen: list[TurnEnd] = []

    @register_environment("test-turn-ends")
    class Recording(Environment):
        def reset(self, prompt, meta):
            return {}

        def step(self, model_turn, state, turn_end=None):
            seen.append(turn_end)
            return Step("five", 0.0, False)

    class Plain(Environment):
        def reset(self, prompt, meta):
            return {}

        def step(self, model_turn, state):
            return Step(model_turn, 0.0, True)

    end = TurnEnd("eos")
    assert step_with(Plain(), "hi", {}, end).observation == "hi"
    path, tok = chat_policy
    env = EnvironmentConfig(
        name="test-turn-ends",
        max_turns=2,
        max_total_tokens=200,
        turn_max_new_tokens=3,
        observation_format="chat",
        stop_strings=["<|im_start|>"],  # a special token as a stop string
    )
    worker = RolloutWorker(path, RolloutConfig(environment=env))
    runner = worker._episodes
    eos, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    five = tok.convert_tokens_to_ids("five")
    out = lambda ids, why: GenerationOutput(np.asarray(ids), np.zeros(len(ids), np.float32), why)  # noqa: E731
    assert runner.turn_text(out([five, eos], "stop")) == ("five", TurnEnd("eos"))
    assert runner.turn_text(out([five, start], "stop")) == (
        "five<|im_start|>",
        TurnEnd("stop", "<|im_start|>"),
    )
    assert runner.turn_text(out([five, five], "length")) == ("five five", TurnEnd("length"))
    prompt = np.asarray(render(tok, [{"role": "user", "content": "what is two plus three"}]), dtype=np.int64)
    samples = worker.generate([0], [prompt], seed=2, sampling=SamplingConfig(n=2, max_new_tokens=3))
    # every turn was asked about (2 episodes x 2 turns), each told the end its last token shows
    reason = {eos: "eos", start: "stop"}
    expected = sorted(
        reason.get(int(s.response_ids[t]), "length") for s in samples for t in s.episode.turn_ends
    )
    assert len(seen) == 4 and sorted(t.reason for t in seen) == expected


def test_the_documented_chat_environment_runs_its_two_tools(tmp_path, chat_policy):
    """docs/environments.md's chat-model environment, taken as a .py module: both tools, several calls
    in one turn answered by one tool message each, bad calls counted, and episodes on a real worker."""
    import json
    from pathlib import Path

    import numpy as np

    from rollout_workers.config import EnvironmentConfig, RolloutConfig, SamplingConfig
    from rollout_workers.environment import as_step
    from rollout_workers.environments import make_environment
    from rollout_workers.worker import RolloutWorker

    page = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    module = tmp_path / "chat_envs.py"
    module.write_text(page.split("```python\n# chat_envs.py\n", 1)[1].split("```", 1)[0])
    env = make_environment("chat-math", str(module))
    state = env.reset("what is 3 km in m plus 1", {"answer": 3001})
    call = lambda name, **args: f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"  # noqa: E731
    both = call("convert", value="3", unit="km", to="m") + " and " + call("calculator", expression="3000+1")
    step = as_step(env.step(both, state))
    assert step.observation == [{"role": "tool", "content": "3000"}, {"role": "tool", "content": "3001"}]
    assert step.info == {"tool_calls": 2.0, "tool_errors": 0.0} and not step.done
    bad = as_step(
        env.step(call("convert", value="3", unit="km", to="h") + "<tool_call>{x</tool_call>", state)
    )
    assert bad.info == {"tool_calls": 2.0, "tool_errors": 2.0}
    assert [m["content"] for m in bad.observation] == ["error: ToolError", "error: JSONDecodeError"]
    assert as_step(env.step("so it is 3001", state)).reward == 1.0
    path, tok = chat_policy
    cfg = EnvironmentConfig(
        name="chat-math",
        module=str(module),
        max_turns=2,
        max_total_tokens=200,
        turn_max_new_tokens=4,
        observation_format="chat",
    )
    worker = RolloutWorker(path, RolloutConfig(environment=cfg))
    prompt = np.asarray(render(tok, [{"role": "user", "content": "what is two plus three"}]), dtype=np.int64)
    samples = worker.generate(
        [0], [prompt], seed=1, sampling=SamplingConfig(n=2, max_new_tokens=4), metas=[{"answer": 5}]
    )
    assert len(samples) == 2 and all(s.episode.status in ("done", "max_turns") for s in samples)
