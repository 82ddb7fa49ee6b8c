"""The calculator demo's task: the problems and their split, the tool's tags and its safe evaluator, the
character tokenizer, the pretraining transcripts, and the episode loop that puts a policy and the
calculator together (see demos/calculator.py for the build).

A transcript is what one episode's token stream reads as, without <bos>/<eos>:

    37*48=<calc>37*48</calc><result>1776</result>1776     the tool used: call, observation, answer
    37*48=1776                                            the tool skipped: a direct answer

The prompt is "37*48="; the policy writes "<calc>37*48</calc>" (its turn ends at </calc>), the
environment appends "<result>1776</result>" (what `calc` returns for the expression written), and the
policy writes its answer and <eos>.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from demos.common import EOS_ID, bos_tokenizer
from demos.common import near_miss as common_near_miss
from rollout_workers.tools import last_integer

MIN_OPERAND, MAX_OPERAND = 10, 99
N_EVAL = 256
N_RL = 2048
N_VAL = 256  # selection problems, carved from the pretraining-only ones and left out of the corpus
N_POSITIONS = 48  # the longest well-formed transcript is 25 tokens with <bos> and <eos>

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

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
ALPHABET = list("0123456789+-*=")
CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = "<calc>", "</calc>", "<result>", "</result>"
TAGS = [CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE]
VOCAB = SPECIAL_TOKENS + ALPHABET + TAGS  # ids 0..20: the tags are 17..20
CALL_OPEN_ID, CALL_CLOSE_ID, RESULT_OPEN_ID, RESULT_CLOSE_ID = (VOCAB.index(t) for t in TAGS)
MAX_TURNS = 3  # policy turns per episode
MAX_EXPR_CHARS = 32
_EXPR = re.compile(r"[0-9]+(?:[-+*][0-9]+)*")
_CALL = re.compile(re.escape(CALL_OPEN) + r"([^<]*)" + re.escape(CALL_CLOSE) + r"\Z")


def problem(a: int, b: int) -> dict[str, Any]:
    """One prompt row: the text the policy continues and the answer the rule reward checks."""
    return {"prompt": f"{a}*{b}=", "answer": str(a * b)}


Pairs = list[tuple[int, int]]


def split_problems(seed: int) -> tuple[Pairs, Pairs, Pairs]:
    """(held-out, RL, pretraining-only) problems: a seeded partition of all a*b with a, b in 10..99."""
    pairs = [(a, b) for a in range(MIN_OPERAND, MAX_OPERAND + 1) for b in range(MIN_OPERAND, MAX_OPERAND + 1)]
    random.Random(f"calc-split-{seed}").shuffle(pairs)
    return pairs[:N_EVAL], pairs[N_EVAL : N_EVAL + N_RL], pairs[N_EVAL + N_RL :]


# --- the tool ---


def calc(expr: str) -> int:
    """The calculator: non-negative integers joined by + - * (the usual precedence, no brackets, no unary
    sign). Anything else raises ValueError; nothing is ever passed to eval."""
    if len(expr) > MAX_EXPR_CHARS or not _EXPR.fullmatch(expr):
        raise ValueError(f"not a calculator expression: {expr!r}")
    total, sign = 0, 1
    for term in re.split(r"([-+])", expr):
        if term in ("+", "-"):
            sign = 1 if term == "+" else -1
            continue
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += sign * product
    return total


def observation(turn: str) -> str | None:
    """What the environment appends after a policy turn: "<result>v</result>" when the turn ends in a
    well-formed call "<calc>expr</calc>" (v = calc(expr)), else None (no call, or a malformed one)."""
    m = _CALL.search(turn)
    if m is None:
        return None
    try:
        return f"{RESULT_OPEN}{calc(m.group(1))}{RESULT_CLOSE}"
    except ValueError:
        return None


# --- the tokenizer ---


def char_tokenizer() -> Any:
    """One token per character, each tool tag one (ordinary, not special) token, <bos> prepended,
    decoded without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
    tags = "|".join(re.escape(t) for t in TAGS)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{tags}|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return bos_tokenizer(tok, N_POSITIONS)


# --- the pretraining transcripts ---


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


def transcript(rng: random.Random, a: int, b: int, kind: str) -> str:
    """One worked example of `kind` (see KINDS) for a*b, without <bos>/<eos>. Every well-formed call is
    followed by what `calc` returns for it."""
    if kind not in KINDS:
        raise ValueError(f"unknown transcript kind {kind!r}")
    prompt, c = f"{a}*{b}=", a * b
    if kind == "direct":
        return f"{prompt}{c if rng.random() < DIRECT_CORRECT_FRAC else near_miss(rng, c)}"
    if kind == "no_close":  # the call never closes: no result comes, the turn ends unanswered
        return f"{prompt}{CALL_OPEN}{a}*{b}"
    x, y = wrong_operands(rng, a, b) if kind == "wrong_operand" else (a, b)
    v = calc(f"{x}*{y}")
    answer = near_miss(rng, v) if kind == "copy_error" else v
    return f"{prompt}{CALL_OPEN}{x}*{y}{CALL_CLOSE}{RESULT_OPEN}{v}{RESULT_CLOSE}{answer}"


def corpus(
    tag: str, pairs: Pairs, n: int, tool_frac: float = TOOL_FRAC, bad_frac: float = BAD_TOOL_FRAC
) -> list[tuple[str, str]]:
    """`n` (kind, transcript) examples over `pairs`, seeded by `tag`: `tool_frac` of them use the tool
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
        out.append((kind, transcript(rng, a, b, kind)))
    return out


def encode(tokenizer: Any, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of transcripts with <eos> appended, and per token 1 where the environment wrote it
    (an observation "<result>...</result>": never the policy's to predict, so out of the LM loss)."""
    ids, env = [], []
    for x in tokenizer(texts).input_ids:
        x = [*x, EOS_ID]
        mask, inside = [], False
        for t in x:
            inside = inside or t == RESULT_OPEN_ID
            mask.append(int(inside))
            inside = inside and t != RESULT_CLOSE_ID
        ids.append(x)
        env.append(mask)
    return ids, env


# --- episodes: a policy and the calculator in a loop ---


@dataclass
class Episode:
    """One problem's token stream as it grows: the prompt, then policy turns and observations."""

    pair: tuple[int, int]
    ids: list[int]
    turns: list[str] = field(default_factory=list)  # the policy's turns, decoded without <pad>/<bos>/<eos>
    calls: int = 0  # turns that ended in a well-formed call
    malformed: int = 0  # turns with a tag of a call ("<calc>" or "</calc>") but no well-formed call

    @property
    def answer(self) -> str:
        return self.turns[-1] if self.turns else ""

    @property
    def correct(self) -> bool:
        """The last turn answers unless it calls: right when its last integer is the product's digits
        (as `rollout_workers.tools.ToolEnvironment` scores a final turn)."""
        return CALL_OPEN not in self.answer and last_integer(self.answer) == str(self.pair[0] * self.pair[1])


TurnSampler = Callable[[list[list[int]]], list[list[int]]]


def run_episodes(
    sample: TurnSampler, tokenizer: Any, pairs: Pairs, max_turns: int = MAX_TURNS
) -> list[Episode]:
    """Play one episode per pair: `sample(streams)` gives each stream's next policy turn (token ids,
    ending at </calc> or <eos> or cut short); a turn ending in a well-formed call gets the calculator's
    observation appended and the policy goes on, anything else ends the episode (so does `max_turns`)."""
    episodes = [Episode(p, tokenizer(problem(*p)["prompt"]).input_ids) for p in pairs]
    active = episodes
    for turn in range(max_turns):
        going = []
        for e, out in zip(active, sample([e.ids for e in active]), strict=True):
            text = tokenizer.decode(out, skip_special_tokens=True)
            e.ids, obs = [*e.ids, *out], observation(text)
            e.turns.append(text)
            e.calls += obs is not None
            e.malformed += obs is None and (CALL_OPEN in text or CALL_CLOSE in text)
            obs_ids = [] if obs is None else tokenizer.encode(obs, add_special_tokens=False)
            if obs is not None and turn + 1 < max_turns and len(e.ids) + len(obs_ids) < N_POSITIONS:
                e.ids += obs_ids
                going.append(e)
        active = going
    return episodes


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """accuracy, tool_call_rate (episodes with >= 1 well-formed call), accuracy_given_call (among those)
    and malformed_call_rate (episodes with a malformed call)."""
    called = [e for e in episodes if e.calls]
    return {
        "accuracy": sum(e.correct for e in episodes) / len(episodes),
        "tool_call_rate": len(called) / len(episodes),
        "accuracy_given_call": sum(e.correct for e in called) / max(1, len(called)),
        "malformed_call_rate": sum(e.malformed > 0 for e in episodes) / len(episodes),
    }
