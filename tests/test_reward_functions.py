"""Reward functions (reward.functions, docs/rewards.md): every form gets the whole sample (prompt text and
messages, response text and ids, finish reason, every column of the row), several functions add up by
their weights and keep their own values, a function that fails makes a counted failure with its message
(never a 0), and config errors name the field."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_models import build_tokenizer

from cluster.config.schema import ConfigError, build_config
from cluster.prompts.loader import Prompt
from cluster.records.chunks import Chunk, PromptFacts, SampleFacts, prompt_facts
from cluster.reporting.metrics import function_metrics, sample_metrics
from reward_service.config import RewardConfig
from reward_service.forms import FORMS, detect_form
from reward_service.functions import RewardInput, reward_function
from reward_service.rules import import_user_module
from reward_service.scorer import RewardScorer
from reward_service.weighted import RewardFunction, load_functions, score_functions

# Every form, each recording what it was given. Values by hand for the two samples of test_every_form_...:
#   sample 0: response "was great" (3 ids with <eos>), finish 'stop',   bonus 2, 2 messages, answer "great"
#   sample 1: response "bad film"  (2 ids),            finish 'length', bonus 5, no messages (plain text)
USER_FUNCTIONS = """
import asyncio

from reward_service.functions import reward_function

SEEN = {}
RUNNING = {"now": 0, "most": 0}


def legacy(prompt, response, meta):
    SEEN.setdefault("legacy", []).append((prompt, response, meta))
    return float(len(response.split()))  # 2, 2


@reward_function(batched=False)
def record(x):
    SEEN.setdefault("record", []).append(x)
    return float(len(x.response_ids))  # 3, 2


@reward_function(batched=True)
def batched(xs):
    SEEN.setdefault("batched", []).append(list(xs))
    return [1.0 if x.finish_reason == "stop" else -1.0 for x in xs]  # 1, -1


@reward_function
async def async_record(x):
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    await asyncio.sleep(0.01)
    RUNNING["now"] -= 1
    SEEN.setdefault("async_record", []).append(x)
    return float(x.meta["bonus"])  # 2, 5


@reward_function(batched=True)
async def async_batched(xs):
    await asyncio.sleep(0)
    SEEN.setdefault("async_batched", []).append(list(xs))
    return [float(len(x.messages or [])) for x in xs]  # 2, 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    SEEN.setdefault("verl", []).append((data_source, solution_str, ground_truth, extra_info))
    return {"score": float(ground_truth in solution_str), "acc": True}  # 1, 0
"""

WEIGHTS = {
    "legacy": 1.0,
    "record": 0.5,
    "batched": 2.0,
    "async_record": -1.0,
    "async_batched": 0.25,
    "verl": 3.0,
}
VALUES = {  # each function's own value per sample, by hand (see USER_FUNCTIONS)
    "legacy": [2.0, 2.0],
    "record": [3.0, 2.0],
    "batched": [1.0, -1.0],
    "async_record": [2.0, 5.0],
    "async_batched": [2.0, 0.0],
    "verl": [1.0, 0.0],
}
# sample 0: 2 + 1.5 + 2 - 2 + 0.5 + 3 = 7.0; sample 1: 2 + 1 - 2 - 5 + 0 + 0 = -4.0
TOTALS = [7.0, -4.0]

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the movie was"}]
ROWS = [
    {  # verl's parquet layout: the ground truth nested in reward_model, an extra_info column
        "data_source": "tiny/sentiment",
        "reward_model": {"style": "rule", "ground_truth": "great"},
        "extra_info": {"split": "train", "index": 0},
        "bonus": 2,
        "answer": "great",
    },
    {"data_source": "tiny/plain", "ground_truth": "good", "bonus": 5, "tags": ["x", "y"]},
]
PROMPT_TEXTS = ["<|system|>be brief<|user|>the movie was<|assistant|>", "the film"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def user_module(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FUNCTIONS)
    return path


def _functions(path, **extra) -> list[dict]:
    names = {"legacy": "legacy", "record": "record", "batched": "batched", "async_record": "async_record"}
    names |= {"async_batched": "async_batched", "verl": "compute_score"}
    return [
        {"name": name, "module": f"{path}:{fn}", "weight": WEIGHTS[name], **extra.get(name, {})}
        for name, fn in names.items()
    ]


def _samples():
    tok = build_tokenizer()
    prompts = [
        np.array([tok.bos_token_id, *tok.encode("the movie was")], dtype=np.int64),
        np.array([tok.bos_token_id, *tok.encode("the film")], dtype=np.int64),
    ]
    responses = [
        np.array([*tok.encode("was great"), tok.eos_token_id], dtype=np.int64),
        np.array(tok.encode("bad film"), dtype=np.int64),
    ]
    return prompts, responses


def test_every_form_gets_the_whole_sample_and_the_weighted_sum_is_right(tokenizer_dir, user_module):
    cfg = RewardConfig(kind="rule", functions=_functions(user_module))
    scorer = RewardScorer(cfg, str(tokenizer_dir))
    prompts, responses = _samples()
    out = scorer.score(
        prompts,
        responses,
        ROWS,
        prompt_texts=PROMPT_TEXTS,
        messages=[MESSAGES, None],
        finish_reasons=["stop", "length"],
    )

    assert out.ok.all() and out.errors == [None, None]
    np.testing.assert_allclose(out.scores, TOTALS)
    assert set(out.function_values) == set(VALUES)
    for name, want in VALUES.items():
        np.testing.assert_allclose(out.function_values[name], want, err_msg=name)

    seen = import_user_module(str(user_module), "test").SEEN
    want = [
        RewardInput(PROMPT_TEXTS[0], MESSAGES, "was great", responses[0].tolist(), "stop", ROWS[0]),
        RewardInput(PROMPT_TEXTS[1], None, "bad film", responses[1].tolist(), "length", ROWS[1]),
    ]
    assert seen["record"] == want and seen["async_record"] == want
    assert seen["batched"] == [want] and seen["async_batched"] == [want]  # one call each, all samples
    assert seen["legacy"] == [(x.prompt, x.response, x.meta) for x in want]
    assert seen["verl"] == [
        ("tiny/sentiment", "was great", "great", {"split": "train", "index": 0}),  # nested, extra_info column
        ("tiny/plain", "bad film", "good", ROWS[1]),  # top-level ground_truth; no extra_info: the row
    ]
    running = import_user_module(str(user_module), "test").RUNNING
    assert running["most"] == 2  # the per-sample async calls ran together (gathered)


def test_the_rule_shorthand_is_one_function_named_by_the_rule(tokenizer_dir):
    cfg = RewardConfig(kind="rule", rule="contains_keyword")
    assert [(f.name, f.weight, f.form) for f in load_functions(cfg)] == [("contains_keyword", 1.0, "rule")]
    prompts, responses = _samples()
    out = RewardScorer(cfg, str(tokenizer_dir)).score(
        prompts, responses, [{"keywords": ["great", "plot"]}, {"keywords": ["good"]}]
    )
    assert out.scores.tolist() == [0.5, 0.0]
    assert out.function_values["contains_keyword"].tolist() == [0.5, 0.0]


def test_a_direct_caller_without_texts_gets_the_decoded_prompt(tokenizer_dir, tmp_path):
    (tmp_path / "echo.py").write_text(
        "from reward_service.functions import reward_function\n"
        "SEEN = []\n"
        "@reward_function\n"
        "def echo(x):\n"
        "    SEEN.append(x)\n"
        "    return 1.0\n"
    )
    cfg = RewardConfig(kind="rule", functions=[{"module": f"{tmp_path / 'echo.py'}:echo"}])
    prompts, responses = _samples()
    RewardScorer(cfg, str(tokenizer_dir)).score(prompts[:1], responses[:1], [{}])
    (x,) = import_user_module(str(tmp_path / "echo.py"), "test").SEEN
    assert (x.prompt, x.messages, x.finish_reason) == ("the movie was", None, None)


# ------------------------------------------------------------------------------------- failures


def _inputs(n: int) -> list[RewardInput]:
    return [RewardInput(f"p{k}", None, f"r{k}", [k], "stop", {"k": k}) for k in range(n)]


def _fn(name, fn, weight=1.0, form=None) -> RewardFunction:
    return RewardFunction(name, weight, fn, form or detect_form(fn, "auto", name))


def _picky(prompt, response, meta):
    k = meta["k"]
    return [1.0, "1.0", math.nan, -math.inf, None, True][k] if k < 6 else 1 / 0


def test_a_failing_sample_is_a_counted_failure_with_its_message_never_a_zero():
    good = _fn("good", lambda p, r, m: 10.0)
    scored = score_functions([good, _fn("picky", _picky, weight=2.0)], _inputs(7), batch_size=64)
    assert scored.total[0] == 12.0 and scored.errors[0] is None
    assert np.isnan(scored.total[1:]).all()  # a failed function fails the sample: no score at all
    np.testing.assert_array_equal(scored.values["good"], [10.0] * 7)  # the others' values are kept
    assert scored.values["picky"][0] == 1.0 and np.isnan(scored.values["picky"][1:]).all()
    errors = scored.errors
    assert errors[1] == "reward function 'picky' returned str '1.0', not a number"
    assert "non-finite score (nan)" in errors[2] and "non-finite score (-inf)" in errors[3]
    assert "NoneType None, not a number" in errors[4] and "bool True, not a number" in errors[5]
    assert errors[6] == "reward function 'picky' raised ZeroDivisionError: division by zero"


def test_the_scorer_counts_function_failures_and_keeps_their_messages(tokenizer_dir, tmp_path):
    (tmp_path / "bad.py").write_text(
        "def half_broken(prompt, response, meta):\n"
        "    if 'film' in response:\n"
        "        raise ValueError('no judge for films')\n"
        "    return float('nan') if meta.get('nan') else 1.0\n"
    )
    cfg = RewardConfig(kind="rule", functions=[{"module": f"{tmp_path / 'bad.py'}:half_broken"}])
    scorer = RewardScorer(cfg, str(tokenizer_dir))
    prompts, responses = _samples()
    out = scorer.score(prompts * 2, responses * 2, [{}, {}, {"nan": True}, {}])
    assert out.ok.tolist() == [True, False, False, False] and np.isnan(out.scores[1:]).all()
    assert out.errors[1] == "reward function 'half_broken' raised ValueError: no judge for films"
    assert "'half_broken' returned a non-finite score (nan)" in out.errors[2]
    assert scorer.stats()["failures"] == 3


def test_a_batched_function_of_the_wrong_length_fails_its_batch_only():
    calls = []

    @reward_function(batched=True)
    def two(xs):
        calls.append(len(xs))
        return [1.0, 1.0]  # right for a call of 2, wrong for the last call, of 1

    scored = score_functions([_fn("two", two)], _inputs(3), batch_size=2)
    assert calls == [2, 1]  # reward.batch_size inputs per call
    assert scored.total[:2].tolist() == [1.0, 1.0] and np.isnan(scored.total[2])
    assert scored.errors == [None, None, "reward function 'two' returned 2 scores for 1 samples"]


def test_batched_results_that_are_no_list_or_raise_fail_every_sample_of_the_call():
    for fn, why in [
        (lambda xs: 1.0, "returned float, not a list of 2 scores"),
        (lambda xs: "12", "returned str, not a list of 2 scores"),
        (lambda xs: [1.0, 2.0, 3.0], "returned 3 scores for 2 samples"),
        (lambda xs: 1 / 0, "raised ZeroDivisionError: division by zero"),
    ]:
        scored = score_functions([_fn("b", fn, form="batched")], _inputs(2), batch_size=8)
        assert scored.errors == [f"reward function 'b' {why}"] * 2 and np.isnan(scored.total).all()
    arrays = score_functions([_fn("b", lambda xs: np.array([0.5, 1.5]), form="batched")], _inputs(2), 8)
    assert arrays.total.tolist() == [0.5, 1.5]


def test_async_failures_fail_their_own_samples():
    @reward_function
    async def sometimes(x):
        if x.meta["k"] == 1:
            raise RuntimeError("judge timed out")
        return float(x.meta["k"])

    @reward_function(batched=True)
    async def never(xs):
        raise ConnectionError("judge down")

    scored = score_functions([_fn("sometimes", sometimes)], _inputs(3), batch_size=8)
    assert scored.total[[0, 2]].tolist() == [0.0, 2.0]
    assert scored.errors[1] == "reward function 'sometimes' raised RuntimeError: judge timed out"
    scored = score_functions([_fn("never", never)], _inputs(2), batch_size=8)
    assert scored.errors == ["reward function 'never' raised ConnectionError: judge down"] * 2


def test_verl_results_and_rows_it_cannot_score():
    def compute_score(data_source, solution_str, ground_truth):  # no extra_info: none is passed
        return {"score": 0.5} if ground_truth == "a" else {"acc": 1.0}

    inputs = [
        RewardInput("p", None, "r", [1], "stop", {"reward_model": {"ground_truth": "a"}}),
        RewardInput("p", None, "r", [1], "stop", {"ground_truth": "b"}),
        RewardInput("p", None, "r", [1], "stop", {"reward_model": {"style": "rule"}, "answer": "a"}),
    ]
    scored = score_functions([_fn("verl", compute_score)], inputs, batch_size=8)
    assert scored.total[0] == 0.5 and np.isnan(scored.total[1:]).all()
    assert "needs a 'score' key; it has ['acc']" in scored.errors[1]
    assert "'ground_truth' column or 'reward_model.ground_truth'" in scored.errors[2]
    assert "['answer', 'reward_model']" in scored.errors[2]


def test_forms_are_told_apart_in_one_place():
    def legacy(prompt, response, meta):
        return 0.0

    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    async def legacy_async(prompt, response, meta):
        return 0.0

    assert detect_form(legacy, "auto", "f") == "rule" and detect_form(legacy_async, "auto", "f") == "rule"
    assert detect_form(verl, "auto", "f") == "verl"
    assert detect_form(reward_function(lambda x: 0.0), "auto", "f") == "record"
    assert detect_form(reward_function(batched=True)(lambda xs: []), "auto", "f") == "batched"
    assert detect_form(lambda xs: [], "batched", "f") == "batched"  # a style for what cannot be decorated
    assert set(FORMS.names()) == {"rule", "record", "batched", "verl"}
    # the config's styles are the registry's forms (and 'auto'), each in its reference text
    from typing import get_args

    from reward_service.config import RewardFunctionConfig

    style = RewardFunctionConfig.model_fields["style"]
    assert get_args(style.annotation) == ("auto", *FORMS.names())
    assert all(f"'{f.name}': {f.summary}" in style.description for f in FORMS)
    with pytest.raises(ValueError, match=r"^f: cannot tell how to call .*@reward_function"):
        detect_form(lambda x: 0.0, "auto", "f")
    with pytest.raises(ValueError, match=r"^g: style 'batched', but the function is marked 'record'"):
        detect_form(reward_function(lambda x: 0.0), "batched", "g")


# ------------------------------------------------------------------------------ config errors


def _config_error(**reward) -> str:
    tree = {"model": {"policy_path": "p"}, "data": {"prompts_path": "x.jsonl"}, "reward": reward}
    with pytest.raises(ConfigError) as err:
        build_config(tree)
    return str(err.value)


def test_config_errors_name_the_field(tmp_path):
    (tmp_path / "y.py").write_text("def f(prompt, response, meta):\n    return 1.0\nNOT_A_FUNCTION = 3\n")
    y = tmp_path / "y.py"
    fine = {"name": "exact_match"}

    def load(*functions):
        return load_functions(RewardConfig(kind="rule", functions=list(functions)))

    with pytest.raises(ValueError, match=rf"^reward\.functions\[1\]\.module: no function 'x' in {y}$"):
        load(fine, {"module": f"{y}:x"})
    with pytest.raises(ValueError, match=r"^reward\.functions\[1\]\.module: 'NOT_A_FUNCTION' .* is a int"):
        load(fine, {"module": f"{y}:NOT_A_FUNCTION"})
    with pytest.raises(ValueError, match=r"^reward\.functions\[0\]\.module: file .*nope\.py' does not exist"):
        load({"module": f"{tmp_path / 'nope.py'}:f"})
    with pytest.raises(
        ValueError, match=r"^reward\.functions\[0\]\.module: cannot import module 'no_such_pkg'"
    ):
        load({"module": "no_such_pkg:f"})
    with pytest.raises(ValueError, match=r"^reward\.functions\[1\]\.name: unknown reward rule 'nope'"):
        load(fine, {"name": "nope"})
    with pytest.raises(ValueError, match=r"^reward\.functions\[0\]\.module: cannot tell how to call"):
        load({"module": "json:dumps"})
    assert [f.name for f in load(fine, {"module": f"{y}:f", "weight": -0.5})] == ["exact_match", "f"]

    assert "reward.functions[1].style: Input should be 'auto', 'rule', 'record', 'batched' or 'verl'" in (
        _config_error(kind="rule", functions=[fine, {"name": "a", "style": "openrlhf"}])
    )
    assert "reward.functions[1].weight: Input should be a valid number" in _config_error(
        kind="rule", functions=[fine, {"name": "a", "weight": "heavy"}]
    )
    assert "reward.functions[0].weight: Input should be a finite number" in _config_error(
        kind="rule", functions=[{"name": "a", "weight": "nan"}]
    )
    assert "reward.functions[0]: Value error, give `name`" in _config_error(
        kind="rule", functions=[{"module": "my_rules.py"}]
    )
    assert "reward.functions[0].name: Value error, 'a b' is no metric name" in _config_error(
        kind="rule", functions=[{"name": "a b"}]
    )
    assert "reward.functions[0].nmae: unknown field" in _config_error(kind="rule", functions=[{"nmae": "a"}])
    assert "reward.functions[1].name: 'f' already names reward.functions[0]" in _config_error(
        kind="rule", functions=[{"module": f"{y}:f"}, {"name": "f"}]
    )
    assert "set one" in _config_error(kind="rule", rule="exact_match", functions=[fine])
    assert "reward.functions: needs reward.kind='rule'" in _config_error(
        kind="model", model_path="m", functions=[fine]
    )
    assert "reward.rule or reward.functions is required" in _config_error(kind="rule")


# ------------------------------------------------------------------------- metrics on the driver


def _chunk(scored) -> Chunk:
    chunk = Chunk(0, [], seed=0)
    chunk.facts = [SampleFacts(0, 0, 3, "stop") for _ in range(len(scored.ok))]
    chunk.scores = scored
    return chunk


def test_each_functions_mean_over_the_successful_samples_reaches_the_step_row(tokenizer_dir, user_module):
    """Sample 2 fails (its row has no ground truth for the verl function): left out of every mean."""
    cfg = RewardConfig(kind="rule", functions=_functions(user_module))
    prompts, responses = _samples()
    out = RewardScorer(cfg, str(tokenizer_dir)).score(
        prompts + prompts[:1],
        responses + responses[:1],
        [*ROWS, {"bonus": 1}],
        prompt_texts=[*PROMPT_TEXTS, "x"],
        messages=[MESSAGES, None, None],
        finish_reasons=["stop", "length", "stop"],
    )
    assert out.ok.tolist() == [True, True, False] and "'verl' raised KeyError" in out.errors[2]
    chunk = _chunk(out)
    stats = SimpleNamespace(empty=0, truncated=0, skipped_long=0)
    row = sample_metrics([(chunk, [0, 1, 2])], 1.0, stats, cfg)
    for name, values in VALUES.items():
        assert row[f"reward/{name}"] == pytest.approx(np.mean(values)), name
    assert row["rollout/reward_mean"] == pytest.approx(np.mean(TOTALS))  # the weighted sum's mean
    assert row["rollout/reward_failures"] == 1.0
    assert function_metrics([(chunk, 0)], prefix="eval/") == {
        f"eval/reward/{n}": v[0] for n, v in VALUES.items()
    }
    model_row = function_metrics([(_chunk(SimpleNamespace(ok=np.ones(1, bool), function_values={})), 0)])
    assert model_row == {}  # no reward functions, no reward/* metrics


def test_the_scorer_is_sent_each_prompts_text_messages_and_row():
    prompts = [
        Prompt(3, "rendered", np.array([1, 2]), {"answer": "a"}, [{"role": "user", "content": "q"}]),
        Prompt(7, "plain", np.array([3]), {}),
    ]
    assert prompt_facts(prompts) == {
        3: PromptFacts("rendered", [{"role": "user", "content": "q"}], {"answer": "a"}),
        7: PromptFacts("plain", None, {}),
    }


def test_the_streaming_scorer_hands_each_sample_its_prompts_text_messages_row_and_finish_reason(
    tokenizer_dir, user_module
):
    """The cluster's glue, without Ray: samples and the driver's prompt facts in, `RewardInput`s out."""
    from cluster.roles.actors import StreamingScorer
    from rollout_workers.types import Sample

    prompts, responses = _samples()
    rows = [
        Prompt(10, PROMPT_TEXTS[0], prompts[0], ROWS[0], MESSAGES),
        Prompt(11, PROMPT_TEXTS[1], prompts[1], ROWS[1]),
    ]
    samples = [
        Sample(p.index, p.ids, r, np.zeros(len(r), np.float32), finish, 0)
        for p, r, finish in zip(rows, responses, ["stop", "length"], strict=True)
    ][::-1]  # samples need not come in prompt order
    cfg = RewardConfig(kind="rule", functions=_functions(user_module))
    out = StreamingScorer(cfg, str(tokenizer_dir)).score_samples(samples, prompt_facts(rows))
    np.testing.assert_allclose(out.scores, TOTALS[::-1])
    (got,) = import_user_module(str(user_module), "test").SEEN["batched"]
    assert [(x.prompt, x.messages, x.finish_reason, x.meta) for x in got] == [
        (PROMPT_TEXTS[1], None, "length", ROWS[1]),
        (PROMPT_TEXTS[0], MESSAGES, "stop", ROWS[0]),
    ]
