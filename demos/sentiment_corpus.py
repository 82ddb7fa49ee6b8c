"""The text side of the "positive reviews" demo (`demos.sentiment`): review corpus, prompts, BPE tokenizer.

Every review is a sentiment-neutral opening ("last night i watched the new comedy") followed by
clauses that all carry one sentiment, so the label is clean and a prompt cut from an opening
leaves the sentiment open: a policy starts near P(positive) = 0.5 and has room to learn.
Pure Python and seeded by `random.Random(seed)`: the same seed gives the same text everywhere.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from demos.common import BOS_ID, EOS_ID, PAD_ID, bos_tokenizer, load_prompts

__all__ = ["build_corpus", "build_prompts", "build_eval_prompts", "load_prompts", "train_tokenizer"]

POSITIVE, NEGATIVE = 1, 0
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]

# fmt: off
_DETS = ["the", "this", "that"]
_MODS = ["", "", "", "new", "latest", "old", "french", "long", "short", "recent", "animated", "original"]
_KINDS = [
    "movie", "film", "movie", "film", "picture", "thriller", "comedy", "drama", "sequel", "western",
    "musical", "documentary", "romance", "cartoon", "remake", "mystery",
]
_WHEN = [
    "last night", "yesterday", "on sunday", "last week", "this weekend", "on friday", "at the cinema",
    "at home", "on tv", "with my family", "with friends", "on a plane",
]
_WATCHERS = [
    "i watched", "i saw", "we watched", "we saw", "my wife and i saw", "i finally watched", "i rented",
    "my friends and i went to see", "we went to see", "my son and i watched", "i caught",
    "my brother and i watched",
]
_POS_ADJ = [
    "great", "wonderful", "brilliant", "excellent", "amazing", "fantastic", "superb", "delightful",
    "charming", "moving", "beautiful", "funny", "gripping", "clever", "stunning", "enjoyable",
    "perfect", "touching", "lovely", "memorable", "hilarious", "powerful", "fresh", "smart", "fun",
]
_NEG_ADJ = [
    "terrible", "awful", "boring", "dull", "bad", "horrible", "dreadful", "weak", "poor", "stupid",
    "tedious", "bland", "messy", "painful", "forgettable", "lazy", "silly", "ugly", "slow", "pointless",
    "predictable", "clumsy", "flat", "annoying", "lifeless",
]
_INTENS = ["", "", "", "really", "truly", "very", "so", "quite", "absolutely", "simply"]
_ASPECTS_ONE = [
    "acting", "plot", "story", "script", "music", "cast", "ending", "dialogue", "direction",
    "soundtrack", "camera work", "lead actor", "pacing", "score", "humor", "final scene",
]
_ASPECTS_MANY = ["characters", "special effects", "jokes", "actors", "songs", "action scenes"]
_POS_VERBS = ["loved", "enjoyed", "adored", "liked", "really liked", "truly loved"]
_NEG_VERBS = ["hated", "disliked", "regretted", "could not stand", "really hated", "did not like"]
_POS_TAILS = [
    "highly recommended", "a must see", "ten out of ten", "i will watch it again",
    "i would recommend it to everyone", "two thumbs up", "worth every penny", "go see it",
    "i want to see it again", "best film of the year",
]
_NEG_TAILS = [
    "a waste of time", "avoid it", "one out of ten", "i walked out early",
    "i would not recommend it to anyone", "i want my money back", "skip it", "what a mess",
    "worst film of the year", "never again",
]
_POS_NOUNS = ["a real treat", "a gem", "a joy to watch", "a masterpiece", "pure fun"]
_NEG_NOUNS = ["a real mess", "a disaster", "a chore to watch", "a failure", "pure torture"]
_LINKS_AFTER_STORY = ["and it was", "and i have to say it was", "and honestly it was", "and overall it was"]
_LINKS_AFTER_STORY_VERB = ["and i", "and we both", "and i must say i"]
# fmt: on


def _pick(rng: random.Random, words: list[str]) -> str:
    return rng.choice(words)


def _noun_phrase(rng: random.Random) -> str:
    mod = _pick(rng, _MODS)
    return " ".join(w for w in (_pick(rng, _DETS), mod, _pick(rng, _KINDS)) if w)


def _adj_phrase(rng: random.Random, adjs: list[str]) -> str:
    first, second = rng.sample(adjs, 2)
    intens = _pick(rng, _INTENS)
    head = f"{intens} {first}".strip()
    return head if rng.random() < 0.5 else f"{head} and {second}"


def _aspect_clause(rng: random.Random, adjs: list[str]) -> str:
    if rng.random() < 0.7:
        return f"the {_pick(rng, _ASPECTS_ONE)} was {_adj_phrase(rng, adjs)}"
    return f"the {_pick(rng, _ASPECTS_MANY)} were {_adj_phrase(rng, adjs)}"


def opening(rng: random.Random) -> tuple[str, str]:
    """A neutral opening and the kind of continuation it needs ("adj", "story")."""
    np_ = _noun_phrase(rng)
    form = rng.random()
    if form < 0.4:
        return np_, "adj"  # "the new comedy" -> "was ..."
    if form < 0.7:
        return f"{_pick(rng, _WHEN)} {_pick(rng, _WATCHERS)} {np_}", "story"
    return f"{_pick(rng, _WATCHERS)} {np_} {_pick(rng, _WHEN)}", "story"


def _neutral_link(rng: random.Random, kind: str) -> tuple[str, str]:
    """The label-free words that join an opening to its first sentiment clause."""
    if kind == "adj":
        return ("was", "adj") if rng.random() < 0.8 else ("is", "adj")
    if rng.random() < 0.6:
        return _pick(rng, _LINKS_AFTER_STORY), "adj"
    return _pick(rng, _LINKS_AFTER_STORY_VERB), "verb"


def _body(rng: random.Random, slot: str, label: int) -> str:
    adjs, verbs = (_POS_ADJ, _POS_VERBS) if label == POSITIVE else (_NEG_ADJ, _NEG_VERBS)
    nouns, tails = (_POS_NOUNS, _POS_TAILS) if label == POSITIVE else (_NEG_NOUNS, _NEG_TAILS)
    if slot == "verb":
        first = f"{_pick(rng, verbs)} it" if rng.random() < 0.6 else f"{_pick(rng, verbs)} every minute of it"
    else:
        first = _adj_phrase(rng, adjs) if rng.random() < 0.8 else _pick(rng, nouns)
    text = first
    if rng.random() < 0.6:
        text += f" and {_aspect_clause(rng, adjs)}"
    if rng.random() < 0.5:
        text += f" . {_pick(rng, tails)}"
    return text


def review(rng: random.Random, label: int, min_words: int = 8, max_words: int = 20) -> tuple[str, str]:
    """One review of the given label as (neutral_head, full_text), redrawn until its length fits."""
    for _ in range(1000):
        head, kind = opening(rng)
        link, slot = _neutral_link(rng, kind)
        neutral = f"{head} {link}"
        text = f"{neutral} {_body(rng, slot, label)}"
        if min_words <= len(text.split()) <= max_words:
            return neutral, text
    raise RuntimeError(f"could not draw a review of {min_words}-{max_words} words; grammar too long/short")


def build_corpus(seed: int, n_reviews: int = 20_000) -> list[tuple[str, int]]:
    """`n_reviews` (text, label) pairs, exactly half positive, in a seeded shuffled order."""
    rng = random.Random(f"corpus-{seed}")
    labels = [POSITIVE] * (n_reviews // 2) + [NEGATIVE] * (n_reviews - n_reviews // 2)
    rng.shuffle(labels)
    return [(review(rng, label)[1], label) for label in labels]


def _cut_opening(rng: random.Random, min_words: int, max_words: int) -> str | None:
    """A prefix of a neutral head (opening + label-free link words), or None if it is too short."""
    head, kind = opening(rng)
    words = f"{head} {_neutral_link(rng, kind)[0]}".split()
    top = min(max_words, len(words))
    return None if top < min_words else " ".join(words[: rng.randint(min_words, top)])


def build_prompts(seed: int, n_prompts: int = 512, min_words: int = 2, max_words: int = 6) -> list[str]:
    """Distinct review openings of `min_words`..`max_words` words, cut inside the neutral head."""
    rng = random.Random(f"prompts-{seed}")
    seen: dict[str, None] = {}
    for _ in range(200 * n_prompts):
        cut = _cut_opening(rng, min_words, max_words)
        if cut is not None:
            seen.setdefault(cut, None)
        if len(seen) == n_prompts:
            return list(seen)
    raise RuntimeError(
        f"only {len(seen)} distinct prompts of {min_words}-{max_words} words; asked {n_prompts}"
    )


def build_eval_prompts(
    seed: int, n_prompts: int, exclude: set[str], min_words: int = 2, max_words: int = 6
) -> list[str]:
    """Held-out openings: `build_prompts`'s kind, from their own seeded stream, none in `exclude`."""
    rng = random.Random(f"eval-prompts-{seed}")
    seen: dict[str, None] = {}
    for _ in range(200 * n_prompts):
        cut = _cut_opening(rng, min_words, max_words)
        if cut is not None and cut not in exclude:
            seen.setdefault(cut, None)
        if len(seen) == n_prompts:
            return list(seen)
    raise RuntimeError(
        f"only {len(seen)} distinct held-out prompts outside the training set; asked {n_prompts}"
    )


def neutral_openings(seed: int, n: int, min_words: int = 2) -> list[str]:
    """`n` label-free review beginnings of any length: the classifier learns P(positive) = 0.5 on them."""
    rng = random.Random(f"neutral-{seed}")
    out: list[str] = []
    while len(out) < n:
        cut = _cut_opening(rng, min_words, 1000)
        if cut is not None:
            out.append(cut)
    return out


def write_prompts(path: str | Path, prompts: list[str]) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)


def vocabulary(corpus: list[tuple[str, int]]) -> set[str]:
    return {w for text, _ in corpus for w in text.split()}


def train_tokenizer(texts: list[str], max_length: int = 64) -> Any:
    """Byte-level BPE that prepends <bos> itself, so `tokenizer(prompt)` matches how the LM was trained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if [tok.token_to_id(s) for s in SPECIAL_TOKENS] != [PAD_ID, BOS_ID, EOS_ID]:
        raise RuntimeError(
            f"special tokens got ids {[tok.token_to_id(s) for s in SPECIAL_TOKENS]}, want 0/1/2"
        )
    return bos_tokenizer(tok, max_length)
