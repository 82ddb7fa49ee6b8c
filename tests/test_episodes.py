"""Multi-turn episodes on a real engine (hf here; the vLLM engine where it imports): token identity
(trained ids = the engine's ids + observation ids, the mask 1 on model tokens only), a one-turn episode
equal to a single-turn generation, the limits (max_turns, max_total_tokens, stop strings) and the
environment's failures (an exception, a time-out) as statuses, never rewards."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from engine_contract_shared import ENGINES, INDICES, PROMPTS, policies  # noqa: F401  (fixture)
from tiny_models import build_tokenizer

from rollout_workers.config import EnvironmentConfig, RolloutConfig, SamplingConfig
from rollout_workers.environment import Environment, Step, as_step, register_environment
from rollout_workers.environments import make_environment
from rollout_workers.worker import RolloutWorker

OBS = "the movie"  # two tokens of the tiny tokenizer


@register_environment("test-one-turn")
class OneTurn(Environment):
    def reset(self, prompt, meta):
        return {}

    def step(self, model_turn, state):
        return "", 1.0, True


@register_environment("test-echo")
class Echo(Environment):
    """Answers every turn with OBS and a reward of 0.5; done after `turns` turns; with `fail` set, a
    prompt whose meta names 'error' raises and one naming 'hang' sleeps past any deadline."""

    def __init__(self, turns: int = 3, hang_s: float = 0.0):
        self.turns, self.hang_s = turns, hang_s
        self.released = threading.Event()

    def reset(self, prompt, meta):
        return {"turn": 0, "mode": meta.get("mode")}

    def step(self, model_turn, state):
        state["turn"] += 1
        if state["mode"] == "error":
            raise RuntimeError("sandbox crashed")
        if state["mode"] == "hang":
            self.released.wait(self.hang_s)
        return Step(
            OBS, 0.5 if state["turn"] < self.turns else 1.0, state["turn"] >= self.turns, {"calls": 1}
        )


@register_environment("test-slow-reset")
class SlowReset(Environment):
    """A prompt whose meta names 'slow' starts its episode (a sandbox, say) only when the test sets
    `released`; every state `close` receives is recorded, and `late_closed` is set when the slow one's is."""

    def __init__(self):
        self.released, self.late_closed = threading.Event(), threading.Event()
        self.opened: list[dict] = []
        self.closed: list[dict] = []

    def reset(self, prompt, meta):
        if meta.get("mode") == "slow":
            self.released.wait()
        state = {"mode": meta.get("mode")}
        self.opened.append(state)
        return state

    def step(self, model_turn, state):
        return "", 1.0, True

    def close(self, state):
        self.closed.append(state)
        if state["mode"] == "slow":
            self.late_closed.set()


def make_worker(path: str, engine: str, **env) -> RolloutWorker:
    cfg = (
        RolloutConfig(engine=engine, environment=EnvironmentConfig(**env))
        if env
        else RolloutConfig(engine=engine)
    )
    return RolloutWorker(path, cfg)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    return request.param


def test_one_turn_episode_is_the_single_turn_generation(policies, engine):  # noqa: F811
    sampling = SamplingConfig(n=3, max_new_tokens=12)
    plain = make_worker(policies[0], engine).generate(INDICES, PROMPTS, seed=7, sampling=sampling)
    episodes = make_worker(policies[0], engine, name="test-one-turn", max_total_tokens=40).generate(
        INDICES, PROMPTS, seed=7, sampling=sampling
    )
    assert len(plain) == len(episodes) == 9
    for a, b in zip(plain, episodes, strict=True):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert b.episode.turns == 1 and b.episode.status == "done" and b.finish_reason == "stop"
        assert b.episode.loss_mask.tolist() == [1] * len(b.response_ids)


def test_trained_ids_are_the_engine_ids_plus_observation_ids(policies, engine):  # noqa: F811
    obs_ids = build_tokenizer().encode(OBS, add_special_tokens=False)
    assert len(obs_ids) == 2
    worker = make_worker(
        policies[0], engine, name="test-echo", max_turns=3, max_total_tokens=60, turn_max_new_tokens=5
    )
    calls: list[list[tuple[list[int], object]]] = []  # per turn: (input ids, output) of the real engine
    real = worker._engine.generate

    def recorded(prompts, *args, **kwargs):
        out = real(prompts, *args, **kwargs)
        calls.append([(p.tolist(), o) for p, outs in zip(prompts, out, strict=True) for o in outs])
        return out

    worker._engine.generate = recorded
    samples = worker.generate(INDICES, PROMPTS, seed=3, sampling=SamplingConfig(n=2, max_new_tokens=5))
    assert len(calls) == 3
    for s in samples:
        e = s.episode
        assert e.status == "done" and e.turns == 3 and s.finish_reason == "stop"
        assert e.info == {"calls": 3.0}
        np.testing.assert_allclose(e.turn_rewards, [0.5, 0.5, 1.0])
        assert e.outcome == 1.0 and e.token_rewards()[e.turn_ends[:2]].tolist() == [0.5, 0.5]
        starts = [0, *(int(t) + 1 + 2 for t in e.turn_ends[:-1])]  # each turn starts after the observation
        mask = np.zeros(len(s.response_ids), dtype=np.uint8)
        for turn, (a, b) in enumerate(zip(starts, e.turn_ends, strict=True)):
            mask[a : b + 1] = 1
            if turn < 2:  # the observation follows, tokenised once, with logprob 0
                assert s.response_ids[b + 1 : b + 3].tolist() == obs_ids
                assert s.logprobs[b + 1 : b + 3].tolist() == [0.0, 0.0]
        assert e.loss_mask.tolist() == mask.tolist()
        assert int(e.turn_ends[-1]) == len(s.response_ids) - 1
    # each turn's ids are exactly what the engine returned for the episode's ids so far
    for s in samples:
        e = s.episode
        starts = [0, *(int(t) + 3 for t in e.turn_ends[:-1])]
        for turn, (a, b) in enumerate(zip(starts, e.turn_ends, strict=True)):
            history = np.concatenate([s.prompt_ids, s.response_ids[:a]]).tolist()
            match = [o for ids, o in calls[turn] if ids == history]
            assert any(o.response_ids.tolist() == s.response_ids[a : b + 1].tolist() for o in match)
            assert any(np.array_equal(o.logprobs, s.logprobs[a : b + 1]) for o in match)


def test_limits_end_episodes_with_their_status(policies, engine):  # noqa: F811
    sampling = SamplingConfig(n=1, max_new_tokens=4)
    turns = make_worker(
        policies[0], engine, name="test-echo", kwargs={"turns": 99}, max_turns=2, max_total_tokens=60
    )
    for s in turns.generate(INDICES, PROMPTS, seed=1, sampling=sampling):
        assert s.episode.status == "max_turns" and s.episode.turns == 2 and s.finish_reason == "length"
    tight = make_worker(
        policies[0], engine, name="test-echo", kwargs={"turns": 99}, max_turns=50, max_total_tokens=20
    )
    for s in tight.generate(INDICES, PROMPTS, seed=1, sampling=sampling):
        assert s.episode.status == "max_tokens"
        assert len(s.prompt_ids) + len(s.response_ids) <= 20
    # episodes that fill the model's whole context, beside ones that end earlier in the same batch
    full = make_worker(
        policies[0], engine, name="test-echo", kwargs={"turns": 99}, max_turns=50, max_total_tokens=64
    )
    ends = [
        len(s.prompt_ids) + len(s.response_ids)
        for s in full.generate(INDICES, PROMPTS, seed=1, sampling=sampling)
    ]
    assert max(ends) <= 64 and max(ends) >= 62
    with pytest.raises(ValueError, match="no room for a model turn"):
        tight.generate([0], [np.arange(1, 21)], seed=1, sampling=sampling)


def test_stop_strings_end_a_turn_and_must_be_one_token(policies, engine):  # noqa: F811
    tok = build_tokenizer()
    dot, the = tok.convert_tokens_to_ids("."), tok.convert_tokens_to_ids("the")
    worker = make_worker(
        policies[0], engine, name="test-echo", stop_strings=[".", "the"], max_turns=3, max_total_tokens=60
    )
    samples = worker.generate(INDICES, PROMPTS, seed=5, sampling=SamplingConfig(n=4, max_new_tokens=10))
    stopped = 0
    for s in samples:
        starts = [0, *(int(t) + 3 for t in s.episode.turn_ends[:-1])]
        for a, b in zip(starts, s.episode.turn_ends, strict=True):
            turn = s.response_ids[a : b + 1].tolist()
            assert not {dot, the} & set(turn[:-1])  # a stop token only ever ends a turn
            stopped += turn[-1] in (dot, the)
    assert stopped > 0
    with pytest.raises(ValueError, match="exactly one token"):
        make_worker(policies[0], engine, name="test-echo", stop_strings=["the movie"], max_total_tokens=60)


def test_environment_errors_and_time_outs_fail_their_episodes_only(policies):  # noqa: F811
    worker = make_worker(
        policies[0], "hf", name="test-echo", kwargs={"hang_s": 60.0}, timeout_s=1.0, max_total_tokens=60
    )
    env = worker._episodes.environment
    metas = [{"mode": "error"}, {"mode": "hang"}, {}]
    t0 = time.perf_counter()
    try:
        samples = worker.generate(
            INDICES, PROMPTS, seed=2, sampling=SamplingConfig(n=2, max_new_tokens=4), metas=metas
        )
    finally:
        env.released.set()  # let the abandoned thread finish
    assert time.perf_counter() - t0 < 55  # the hung call was abandoned at its deadline, not waited for
    status = [s.episode.status for s in samples]
    assert status == ["env_error"] * 2 + ["env_timeout"] * 2 + ["done"] * 2
    assert "sandbox crashed" in samples[0].episode.error and "timed out" in samples[2].episode.error
    assert all(len(s.response_ids) >= 1 for s in samples)


def test_a_reset_past_its_deadline_has_its_state_closed_when_it_comes(policies):  # noqa: F811
    """The slow reset's episode fails as a time-out at once; the state its reset returns afterwards (a
    sandbox that would otherwise live on) goes to the environment's close and is counted."""
    worker = make_worker(policies[0], "hf", name="test-slow-reset", timeout_s=0.5, max_total_tokens=60)
    env = worker._episodes.environment
    try:
        samples = worker.generate(
            INDICES,
            PROMPTS,
            seed=2,
            sampling=SamplingConfig(n=1, max_new_tokens=4),
            metas=[{}, {"mode": "slow"}, {}],
        )
        assert [s.episode.status for s in samples] == ["done", "env_timeout", "done"]
        assert [state["mode"] for state in env.closed] == [None, None]  # the slow reset has not answered
    finally:
        env.released.set()  # the blocked reset answers now, long past its deadline
    assert env.late_closed.wait(60), "the state of the reset that answered late was never closed"
    assert sorted(map(id, env.closed)) == sorted(map(id, env.opened))  # every state closed, once
    stats = worker.stats()
    assert stats["env_late_answers"] == 1 and stats["env_late_close_errors"] == 0


def test_the_documented_environment_example_runs_in_episodes(policies, tmp_path):  # noqa: F811
    """The user-written environment of docs/environments.md, taken as a .py module and run in episodes."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "environments.md").read_text()
    code = page.split("```python\n# my_envs.py\n", 1)[1].split("```", 1)[0]
    module = tmp_path / "my_envs.py"
    module.write_text(code)
    env = make_environment("guess", str(module), {"low": 1, "high": 100})
    state = env.reset("guess a number", {"seed": 3})
    target = state["target"]
    assert as_step(env.step(f"{target - 1}", state)).observation == " higher:"
    assert as_step(env.step("none", state)).info == {"invalid": 1.0}
    assert as_step(env.step(str(target), state)).done
    worker = make_worker(
        policies[0], "hf", name="guess", module=str(module), max_turns=3, max_total_tokens=60
    )
    samples = worker.generate(INDICES, PROMPTS, seed=4, sampling=SamplingConfig(n=2, max_new_tokens=4))
    assert {s.episode.status for s in samples} <= {"done", "max_turns"}
    assert all(s.episode.turns == 3 for s in samples if s.episode.status == "max_turns")
