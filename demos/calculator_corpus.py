"""The calculator demo's task, spoken as a chat model speaks it: the problems and their split, the
ChatML-style tokenizer and chat template, the pretraining conversations, and the episode loop that puts
a policy and the run's own `tools` environment together (see demos/calculator.py for the build).

An episode, as the chat template renders it (role markers are special tokens; the policy writes the
assistant turns, each ending at <|im_end|>, and the environment the tool message between them):

    <|im_start|>user\\n37*48=<|im_end|>\\n<|im_start|>assistant\\n                       the prompt
    <tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call><|im_end|>
    \\n<|im_start|>tool\\n1776<|im_end|>\\n<|im_start|>assistant\\n                      the observation
    1776<|im_end|>                                                                  the answer

The tool call is the Hermes-style JSON of Qwen2.5's templates, read by `rollout_workers.tools`'
`hermes` parser; the observation is rendered by `rollout_workers.chat_turns` exactly as the RL run
renders it. Without the tool the policy answers at once: "1776<|im_end|>" after the prompt.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from demos.common import EOS_ID
from demos.common import near_miss as common_near_miss
from rollout_workers.chat_turns import ChatObservations, chat_observations
from rollout_workers.tools import HERMES_TAGS, ToolEnvironment, calculator

MIN_OPERAND, MAX_OPERAND = 10, 99
N_EVAL = 256
N_RL = 2048
N_VAL = 256  # selection problems, carved from the pretraining-only ones and left out of the corpus
# The longest well-formed episode with one call is 47 tokens; 96 leaves room for a third turn.
N_POSITIONS = 96

# The corpus mix (shares of examples). The rest are direct answers, right DIRECT_CORRECT_FRAC of the time.
TOOL_FRAC = 0.22  # the tool used correctly
BAD_TOOL_FRAC = 0.05  # the tool used badly, split as BAD_KINDS says
# Mostly calls never closed: a wrong operand or a miscopied result also teaches the policy to make that
# mistake after a well-formed call, and accuracy given a call must stay high (see calculator.Band).
BAD_KINDS = {"wrong_operand": 0.2, "no_close": 0.7, "copy_error": 0.1}
DIRECT_CORRECT_FRAC = 0.2
# Share of examples over the problems with a 3-digit product (15% of all): copying a result of either
# length back is what the policy must learn, and at their natural share the 3-digit ones lag behind.
SHORT_PRODUCT_FRAC = 0.4
KINDS = ("tool", *BAD_KINDS, "direct")

# --- the tokenizer and the chat template ---

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# ids 0/1/2: the pad, the turn opener and the end of turn (= EOS, where generation stops), as Qwen's
SPECIAL_TOKENS = ["<|endoftext|>", IM_START, IM_END]
# Ordinary tokens of more than one character, standing in for a BPE's merges: the role names, the
# tool-call tags and the pieces of the call's JSON (one token per digit, as Llama's and Qwen's split them).
WORDS = [
    "system",
    "user",
    "assistant",
    "tool",
    "error",
    *HERMES_TAGS,
    '{"name": "',
    "calculator",
    '", "arguments": {"',
    "expression",
    '": "',
    '"}}',
]
ALPHABET = list("0123456789+-*= \n")
VOCAB = SPECIAL_TOKENS + WORDS + ALPHABET
TOOL_CALL_ID = VOCAB.index(HERMES_TAGS[0])
MAX_TURNS = 3  # policy turns per episode

# ChatML, with tool calls written the way the policy writes them (no newlines inside the call).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) "
    "+ '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat_tokenizer() -> Any:
    """The policy's tokenizer: the vocabulary above (no BOS: the template opens every message), its
    ChatML template, <|im_end|> as EOS and <|endoftext|> as pad, decoded without spaces."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token=SPECIAL_TOKENS[0]))
    words = "|".join(re.escape(w) for w in sorted(WORDS, key=len, reverse=True))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|\\n|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS[0],
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        model_max_length=N_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --- the problems ---


def problem(a: int, b: int) -> dict[str, Any]:
    """One prompt row: the conversation so far (one user message) and the answer the environment checks."""
    return {"messages": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b)}


Pairs = list[tuple[int, int]]


def split_problems(seed: int) -> tuple[Pairs, Pairs, Pairs]:
    """(held-out, RL, pretraining-only) problems: a seeded partition of all a*b with a, b in 10..99."""
    pairs = [(a, b) for a in range(MIN_OPERAND, MAX_OPERAND + 1) for b in range(MIN_OPERAND, MAX_OPERAND + 1)]
    random.Random(f"calc-split-{seed}").shuffle(pairs)
    return pairs[:N_EVAL], pairs[N_EVAL : N_EVAL + N_RL], pairs[N_EVAL + N_RL :]


def tool_call(expression: str) -> str:
    """The text of one well-formed call, as the template renders an assistant tool call."""
    args = json.dumps({"expression": expression})
    return f'{HERMES_TAGS[0]}{{"name": "calculator", "arguments": {args}}}{HERMES_TAGS[1]}'


# --- the pretraining conversations ---


def near_miss(rng: random.Random, value: int) -> int:
    """A plausible wrong number: off by 1, 2, 10 or 100 either way, or two adjacent digits swapped;
    never `value`, never negative."""
    return common_near_miss(rng, value, (-100, -10, -2, -1, 1, 2, 10, 100))


def wrong_operands(rng: random.Random, a: int, b: int) -> tuple[int, int]:
    """(a, b) with one operand replaced by a different two-digit near miss."""
    first = rng.random() < 0.5
    while True:
        x = near_miss(rng, a if first else b)
        if MIN_OPERAND <= x <= MAX_OPERAND:
            return (x, b) if first else (a, x)


def conversation(rng: random.Random, a: int, b: int, kind: str) -> list[dict[str, Any]]:
    """One worked example of `kind` (see KINDS) for a*b, as chat messages. Every well-formed call is
    followed by the tool message the calculator answers it with; a call never closed ends the example."""
    if kind not in KINDS:
        raise ValueError(f"unknown conversation kind {kind!r}")
    messages, c = problem(a, b)["messages"], a * b
    if kind == "direct":
        answer = c if rng.random() < DIRECT_CORRECT_FRAC else near_miss(rng, c)
        return [*messages, {"role": "assistant", "content": str(answer)}]
    if kind == "no_close":
        return [
            *messages,
            {"role": "assistant", "content": tool_call(f"{a}*{b}").removesuffix('"}}' + HERMES_TAGS[1])},
        ]
    x, y = wrong_operands(rng, a, b) if kind == "wrong_operand" else (a, b)
    v = int(calculator(f"{x}*{y}"))
    answer = near_miss(rng, v) if kind == "copy_error" else v
    return [
        *messages,
        {"role": "assistant", "content": tool_call(f"{x}*{y}")},
        {"role": "tool", "content": str(v)},
        {"role": "assistant", "content": str(answer)},
    ]


def corpus(
    tag: str, pairs: Pairs, n: int, tool_frac: float = TOOL_FRAC, bad_frac: float = BAD_TOOL_FRAC
) -> list[tuple[str, list[dict[str, Any]]]]:
    """`n` (kind, conversation) examples over `pairs`, seeded by `tag`: `tool_frac` of them use the tool
    right, `bad_frac` badly (BAD_KINDS), the rest answer directly; SHORT_PRODUCT_FRAC of them over the
    pairs whose product has 3 digits."""
    rng = random.Random(f"calc-corpus-{tag}")
    kinds, weights = list(KINDS), [tool_frac, *(bad_frac * s for s in BAD_KINDS.values())]
    weights.append(1.0 - sum(weights))
    short = [p for p in pairs if p[0] * p[1] < 1000]
    long = [p for p in pairs if p[0] * p[1] >= 1000]
    out = []
    for _ in range(n):
        a, b = rng.choice(short if short and (rng.random() < SHORT_PRODUCT_FRAC or not long) else long)
        kind = rng.choices(kinds, weights)[0]
        out.append((kind, conversation(rng, a, b, kind)))
    return out


def encode(
    tokenizer: Any, conversations: list[list[dict[str, Any]]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of conversations built the way an RL episode builds them (the prompt rendered with the
    generation prompt, each assistant turn's ids ending at <|im_end|>, each tool message appended by the
    run's own observation renderer), and per token 1 where the environment wrote it (never the policy's
    to predict). The ids equal the template's render of the whole conversation, up to its last
    <|im_end|> (tests/test_demo_calculator_build.py checks it)."""
    render = observations(tokenizer)
    cache: dict[tuple, list[int]] = {}

    def once(key: tuple, make: Callable[[], list[int]]) -> list[int]:
        if key not in cache:
            cache[key] = make()
        return cache[key]

    ids, env = [], []
    for messages in conversations:
        user = messages[0]["content"]
        x = list(once(("prompt", user), lambda u=user: prompt_ids(tokenizer, u)))
        mask, turn = [0] * len(x), []
        for m in messages[1:]:
            text = m["content"]
            if m["role"] == "assistant":
                turn = [
                    *once(("text", text), lambda t=text: tokenizer.encode(t, add_special_tokens=False)),
                    EOS_ID,
                ]
                x, mask = x + turn, mask + [0] * len(turn)
            else:
                obs = once(("tool", text), lambda t=text, last=turn: render(last, t, [EOS_ID]))
                x, mask = x + obs, mask + [1] * len(obs)
        ids.append(x)
        env.append(mask)
    return ids, env


def prompt_ids(tokenizer: Any, content: str) -> list[int]:
    """A user message rendered by the chat template with the assistant's generation prompt."""
    messages = [{"role": "user", "content": content}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def observations(tokenizer: Any) -> ChatObservations:
    """The run's renderer of tool messages for this tokenizer (`rollout_workers.chat_turns`)."""
    return chat_observations(tokenizer, "tool", stops=[EOS_ID])


# --- episodes: a policy and the run's tools environment in a loop ---


@dataclass
class Episode:
    """One problem's token stream as it grows: the prompt, then policy turns and observations."""

    pair: tuple[int, int]
    ids: list[int]
    turns: list[str] = field(default_factory=list)  # the policy's turns, decoded without special tokens
    calls: int = 0  # turns the calculator answered with a result
    malformed: int = 0  # turns with a call the environment refused (answered "error")
    reward: float = 0.0  # the environment's outcome; 0 for an episode it did not end

    @property
    def correct(self) -> bool:
        return self.reward == 1.0


TurnSampler = Callable[[list[list[int]]], list[list[int]]]


def run_episodes(
    sample: TurnSampler, tokenizer: Any, pairs: Pairs, max_turns: int = MAX_TURNS
) -> list[Episode]:
    """Play one episode per pair as the RL run plays it: `sample(streams)` gives each stream's next
    policy turn (token ids, ending at <|im_end|> or cut short); the built-in `tools` environment with
    Hermes calls reads the turn's text, a call is answered by a tool message rendered by the run's
    renderer and the policy goes on, a turn without a call is the scored answer. An episode ends
    unscored (0) after `max_turns` turns or when the next observation would pass N_POSITIONS."""
    env, render = ToolEnvironment(call_format="hermes"), observations(tokenizer)
    episodes = [Episode(p, prompt_ids(tokenizer, problem(*p)["messages"][0]["content"])) for p in pairs]
    states = {id(e): env.reset("", {"answer": problem(*e.pair)["answer"]}) for e in episodes}
    active = episodes
    for turn in range(max_turns):
        going = []
        for e, out in zip(active, sample([e.ids for e in active]), strict=True):
            text = tokenizer.decode(out, skip_special_tokens=True)
            e.ids = [*e.ids, *out]
            e.turns.append(text)
            step = env.step(text, states[id(e)])
            if step.done:
                e.reward = float(step.reward or 0.0)
                continue
            e.malformed += int(step.info["tool_errors"])
            e.calls += int(step.info["tool_calls"] - step.info["tool_errors"])
            obs = render(out, step.observation, [EOS_ID])
            if turn + 1 < max_turns and len(e.ids) + len(obs) < N_POSITIONS:
                e.ids += obs
                going.append(e)
        active = going
    return episodes


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """accuracy, tool_call_rate (episodes with >= 1 call the calculator answered), accuracy_given_call
    (among those) and malformed_call_rate (episodes with a refused call)."""
    called = [e for e in episodes if e.calls]
    return {
        "accuracy": sum(e.correct for e in episodes) / len(episodes),
        "tool_call_rate": len(called) / len(episodes),
        "accuracy_given_call": sum(e.correct for e in called) / max(1, len(called)),
        "malformed_call_rate": sum(e.malformed > 0 for e in episodes) / len(episodes),
    }
