"""Dynamic sampling (`data.dynamic_sampling`): the pure rules and accounting, then both pipelines on a
real local Ray with the demo models and a rule reward whose groups are flat for some prompts."""

from __future__ import annotations

import collections
import json
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.config.filters import check_filter_spec
from cluster.config.schema import ConfigError, build_config
from cluster.pipeline.dynamic_sampling import (
    DynamicSamplingError,
    StepAccount,
    keeps,
    resolve_filter,
    round_seed,
    split_chunk,
)
from cluster.prompts.loader import Prompt, PromptStream
from cluster.records.chunks import SampleFacts
from cluster.records.groups import LostInputs

# ---------------------------------------------------------------------- pure rules


def test_builtin_filters():
    assert resolve_filter("none") is None
    keep = resolve_filter("nonzero_std", std_eps=0.1)
    assert keep(np.array([0.0, 1.0])) and not keep(np.array([1.0, 1.0, 1.0]))
    assert not keep(np.array([0.5, 0.55]))  # std 0.025 <= eps
    assert not keep(np.array([1.0]))  # one sample has no spread
    assert not keeps(keep, np.array([]))  # no successful reward: filtered, never asked
    assert keeps(None, np.array([1.0, 1.0]))  # no filter: everything is kept


def test_a_user_function_by_module_path_or_file(tmp_path, monkeypatch):
    src = (
        "def any_right(rewards):\n    return bool((rewards >= 1).any()) and not bool((rewards >= 1).all())\n"
    )
    (tmp_path / "my_filters.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("my_filters:any_right", f"{tmp_path / 'my_filters.py'}:any_right"):
        keep = resolve_filter(spec)
        assert (
            keep(np.array([0.0, 1.0])) and not keep(np.array([1.0, 1.0])) and not keep(np.array([0.0, 0.0]))
        )
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_filter("my_filters:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        resolve_filter("no_such_mod_xyz:f")


def test_filter_spec_names_the_allowed_values():
    assert check_filter_spec("pkg.mod:fn") == "pkg.mod:fn"
    assert check_filter_spec("a/b.py:fn") == "a/b.py:fn"
    for bad in ("std", "mod.fn", "mod:", ":fn", "mod:1x"):
        with pytest.raises(ValueError, match="allowed: 'none', 'nonzero_std'"):
            check_filter_spec(bad)


BASE = {"model": {"policy_path": "p"}, "data": {"prompts_path": "x"}, "reward": {"model_path": "r"}}


def _tree(ds, n=4):
    return {**BASE, "data": {"prompts_path": "x", "dynamic_sampling": ds}, "rollout": {"sampling": {"n": n}}}


def test_config_names_the_field_and_refuses_one_sample_per_prompt():
    cfg = build_config(BASE)
    assert cfg.data.dynamic_sampling.filter == "none" and not cfg.data.dynamic_sampling.enabled
    assert (
        build_config(_tree({"filter": "nonzero_std", "max_rounds": 3})).data.dynamic_sampling.max_rounds == 3
    )
    with pytest.raises(ConfigError) as info:
        build_config(_tree({"filter": "zero_var"}))
    assert "data.dynamic_sampling.filter" in str(info.value) and "'nonzero_std'" in str(info.value)
    with pytest.raises(ConfigError, match=r"data\.dynamic_sampling\.max_rounds"):
        build_config(_tree({"filter": "nonzero_std", "max_rounds": 0}))
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.n >= 2"):
        build_config(_tree({"filter": "nonzero_std"}, n=1))
    assert build_config(_tree({"filter": "none"}, n=1))  # off: any n


def _chunk(prompts, rewards, ok=None):
    """A scored chunk: `rewards[i]` are prompt i's samples' rewards."""
    facts = [SampleFacts(p.index, 0, 3, "stop") for p, rs in zip(prompts, rewards, strict=True) for _ in rs]
    flat = [r for rs in rewards for r in rs]
    ok = np.ones(len(flat), dtype=bool) if ok is None else np.asarray(ok)
    scores = SimpleNamespace(
        scores=np.asarray(flat, dtype=np.float32), returns=np.asarray(flat, np.float32), ok=ok
    )
    return SimpleNamespace(prompts=prompts, facts=facts, scores=scores)


def _prompts(n):
    return [Prompt(i, f"p{i}", np.array([1, i + 3]), {}) for i in range(n)]


def test_split_chunk_keeps_groups_with_spread_and_ignores_failed_rewards():
    ps = _prompts(3)
    chunk = _chunk(ps, [[1.0, 1.0], [0.0, 1.0], [0.0, 1.0]], ok=[True, True, True, True, True, False])
    kept, filtered = split_chunk(chunk, resolve_filter("nonzero_std"))
    assert kept == {1: [2, 3]} and filtered == [0, 2]  # prompt 2: one successful reward, no spread
    kept, filtered = split_chunk(chunk, None)
    assert kept == {0: [0, 1], 1: [2, 3], 2: [4, 5]} and filtered == []


def test_a_prompt_drawn_twice_into_one_chunk_is_two_groups():
    """A shuffled epoch's end and the next one's start can put one prompt twice in a chunk: each copy
    is its own group of n samples, kept or filtered and counted once per draw (the accounting's
    drawn = kept + filtered holds)."""
    ps = _prompts(3)
    chunk = _chunk([ps[1], ps[0], ps[1]], [[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    kept, filtered = split_chunk(chunk, resolve_filter("nonzero_std"))
    assert kept == {0: [0, 1]} and filtered == [0, 1]  # prompt 1's first copy has spread, its second not
    kept, filtered = split_chunk(chunk, None)
    assert kept == {0: [0, 1], 1: [2, 3], 2: [4, 5]} and filtered == []
    account = StepAccount(3)
    kept, filtered = split_chunk(chunk, resolve_filter("nonzero_std"))
    account.record_round(len(chunk.prompts), len(kept), filtered)  # refused before: 2 groups under 1 key
    assert account.metrics()["dynamic/filtered_groups"] == 2


def test_round_seeds():
    assert round_seed(11, 0) == 11  # a step without refill samples as without dynamic sampling
    seeds = {round_seed(11, r) for r in range(1, 6)}
    assert len(seeds) == 5 and 11 not in seeds


def _simulate_sync(stream, P, flat, max_rounds, steps):
    """The sync loop of `SyncPipeline.collect_informative` without Ray: per step, the kept prompts and the account."""
    out = []
    for _ in range(steps):
        acct, kept, want = StepAccount(P), [], P
        while True:
            prompts = stream.next_batch(want)
            k = [p.index for p in prompts if p.index not in flat]
            acct.record_round(len(prompts), len(k), [p.index for p in prompts if p.index in flat])
            kept += k
            if acct.finished(max_rounds):
                break
            want = acct.next_draw()
        acct.check_trainable(max_rounds)
        out.append((kept, acct))
    return out


def test_sync_accounting_draws_exactly_the_missing_groups_and_ends_every_prompt_once():
    P, flat = 4, {i for i in range(24) if i % 3 == 0}
    stream = PromptStream(_prompts(24), seed=0, shuffle=False)
    rows = _simulate_sync(stream, P, flat, max_rounds=8, steps=4)
    trained = collections.Counter(i for kept, _ in rows for i in kept)
    filtered = collections.Counter(i for _, a in rows for i in a.filtered_prompts)
    assert all(len(kept) == P for kept, _ in rows)
    assert [a.metrics()["dynamic/filtered_groups"] for _, a in rows] == [2, 2, 2, 2]
    assert [a.metrics()["dynamic/extra_prompts"] for _, a in rows] == [2, 2, 2, 2]
    assert [a.metrics()["dynamic/rounds"] for _, a in rows] == [2, 2, 2, 2]
    assert trained == {i: 1 for i in range(24) if i not in flat}
    assert filtered == {i: 1 for i in flat}


def test_sync_accounting_trains_short_after_max_rounds_and_refuses_an_empty_batch():
    stream = PromptStream(_prompts(24), seed=0, shuffle=False)
    ((kept, acct),) = _simulate_sync(stream, 4, flat=set(range(0, 24)) - {1}, max_rounds=2, steps=1)
    assert (
        kept == [1]
        and acct.rounds == 2
        and acct.drawn == 7
        and acct.metrics()["dynamic/shortfall_groups"] == 3
    )
    with pytest.raises(DynamicSamplingError, match="data.dynamic_sampling.max_rounds=2"):
        _simulate_sync(stream, 4, flat=set(range(24)), max_rounds=2, steps=1)


def test_an_inconsistent_round_is_refused():
    with pytest.raises(ValueError, match="drew 4 prompts"):
        StepAccount(4).record_round(4, 3, [])


def _guess_episode(wrong: int):
    """The README's guessing game: `wrong` wrong guesses (-0.05 each, one model token and one observation
    token per turn), then the right one (1.0, the outcome)."""
    from rollout_workers.environment import Episode
    from rollout_workers.types import Sample

    response = np.array([11, 4] * wrong + [11])
    episode = Episode(
        loss_mask=np.array([1, 0] * wrong + [1], dtype=np.uint8),
        turn_ends=np.arange(0, 2 * wrong + 1, 2),
        turn_rewards=np.array([-0.05] * wrong + [1.0], dtype=np.float32),
        status="done",
    )
    return Sample(
        0, np.array([4, 5]), response, np.zeros(len(response), np.float32), "stop", 0, episode=episode
    )


def test_the_filter_and_the_reward_metric_read_each_episodes_return(tmp_path):
    """Group 0: all four episodes right in the end, after 0-3 wrong guesses: equal outcomes (1.0) but
    returns 1, .95, .9, .85, which grpo trains on (advantages +-1.16 and +-0.39: the learner's side is
    tests/test_multiturn_learner.py), so the group is kept. Group 1: right at once, all four: returns 1,
    1, 1, 1, filtered. rollout/reward_mean is the mean return of the trained group, 0.925."""
    from tiny_models import build_tokenizer

    from cluster.records.chunks import Chunk, sample_facts
    from cluster.reporting.metrics import sample_metrics
    from reward_service.config import RewardConfig
    from reward_service.scorer import RewardScorer

    build_tokenizer().save_pretrained(tmp_path)
    samples = [_guess_episode(k) for k in range(4)] + [_guess_episode(0) for _ in range(4)]
    for k, s in enumerate(samples):
        s.prompt_index = k // 4
    scorer = RewardScorer(RewardConfig(kind="environment"), str(tmp_path))
    scored = scorer.score(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], None, [s.episode for s in samples]
    )
    chunk = Chunk(0, _prompts(2), seed=0)
    chunk.facts, chunk.scores = [sample_facts(s) for s in samples], scored
    kept, filtered = split_chunk(chunk, resolve_filter("nonzero_std"))
    assert kept == {0: [0, 1, 2, 3]} and filtered == [1]
    assert scored.scores.tolist() == [1.0] * 8  # the outcomes
    np.testing.assert_allclose(scored.returns, [1.0, 0.95, 0.9, 0.85, 1.0, 1.0, 1.0, 1.0], rtol=1e-6)
    stats = SimpleNamespace(empty=0, truncated=0, skipped_long=0)
    m = sample_metrics([(chunk, kept[0])], 1.0, stats, RewardConfig(kind="environment"))
    assert m["rollout/reward_mean"] == pytest.approx(0.925, rel=1e-6)


# ---------------------------------------------------------------------- real Ray, both pipelines

FLAT_RULE = """
import random
from reward_service.rules import register_reward

@register_reward("flat_or_random")
def flat_or_random(prompt, response, meta):
    # flat prompts: every sample scores the same (no signal); others: a spread with probability 1
    return 0.5 if meta.get("flat") else random.random()
"""


def _flat_prompts(assets, folder, n):
    """The first n demo prompts, every third one (line index % 3 == 0) marked flat."""
    rows = [json.loads(r) for r in assets.prompts.read_text().splitlines()[:n]]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({**r, "flat": i % 3 == 0}) + "\n" for i, r in enumerate(rows)))
    return path, {i for i in range(n) if i % 3 == 0}


def _dyn_cfg(assets, tmp_path, steps, n_prompts, **extra):
    from demo_run import CONFIG, demo_overrides

    from cluster.config.schema import load_config

    module = tmp_path / "flat_rule.py"
    module.write_text(FLAT_RULE)
    prompts, flat = _flat_prompts(assets, tmp_path, n_prompts)
    sets = {
        "data.prompts_path": prompts,
        "data.meta_keys": "[flat]",
        "data.shuffle": "false",
        "data.prompts_per_step": 4,
        "data.dynamic_sampling.filter": "nonzero_std",
        "data.dynamic_sampling.max_rounds": 8,
        "rollout.sampling.n": 2,
        "rollout.chunk_size": 2,
        "rollout.num_cpus_per_worker": 0.25,
        "learner.advantage": "grpo",
        "learner.micro_batch_size": 8,
        "reward.kind": "rule",
        "reward.rule": "flat_or_random",
        "reward.rule_module": module,
        **extra,
    }
    return load_config(CONFIG, demo_overrides(assets, steps, **sets)), flat


def _groups_of(parts):
    """prompt index -> rewards of its trained samples."""
    out = collections.defaultdict(list)
    for c, pos in parts:
        for j in pos:
            if c.scores.ok[j]:
                out[c.facts[j].prompt_index].append(float(c.scores.scores[j]))
    return out


@pytest.mark.slow
def test_sync_trains_full_batches_of_informative_groups_across_a_resume(ray_local, demo_assets, tmp_path):
    """24 prompts in order, every third flat, 4 per step: each step draws 4, filters the 2 flat ones,
    draws 2 more (2 rounds), trains 4 groups with spread; 4 steps use the epoch exactly, each prompt
    trained or filtered once, including across a resume from step 2's checkpoint."""
    from cluster.pipeline.checkpoint import latest_checkpoint
    from cluster.pipeline.run import Run

    # the demo's colocated placement: the rounds, filter and resume are the sync pipeline's, not the placement's
    extra = {"checkpoint.every_steps": 2, "cluster.placement": "colocated"}
    cfg, flat = _dyn_cfg(demo_assets, tmp_path, 4, 24, **extra)
    batches, rows = [], []

    def run(trainer, steps):
        try:
            learn = trainer.learner.learn

            def spy(batch, *args):
                batches.append(_groups_of(batch.parts))
                return learn(batch, *args)

            trainer.learner.learn = spy
            rows.extend(trainer.iteration() for _ in range(steps))
            return trainer
        finally:
            trainer.close()

    first = run(Run(cfg, tmp_path / "run"), 2)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step-000002"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["filtered_total"] == 4 and sorted(map(int, state["filtered_prompts"])) == [0, 3, 6, 9]
    resumed = run(Run(cfg, tmp_path / "run", resume_from=ckpt), 2)
    assert resumed.step == 4 and dict(first.progress.filtered_prompts) == {0: 1, 3: 1, 6: 1, 9: 1}
    for groups in batches:
        assert len(groups) == 4  # exactly prompts_per_step groups
        assert all(
            len(rs) == 2 and np.std(rs) > 0 for rs in groups.values()
        )  # every trained group has spread
    for m in rows:
        assert (m["dynamic/filtered_groups"], m["dynamic/extra_prompts"], m["dynamic/rounds"]) == (2, 2, 2)
        assert m["dynamic/shortfall_groups"] == 0 and m["rollout/samples"] == 8
    assert [m["dynamic/filtered_total"] for m in rows] == [2, 4, 6, 8]
    # over the epoch every drawn prompt is trained or filtered exactly once, as the rule implies
    assert resumed.progress.trained_prompts == {i: 1 for i in range(24) if i not in flat}
    assert resumed.progress.filtered_prompts == {i: 1 for i in flat}
    assert resumed.stream.state_dict() == {"epoch": 0, "offset": 24}


@pytest.mark.slow
def test_async_filters_groups_as_they_enter_the_buffer(ray_local, demo_assets, tmp_path):
    """Async, eta = 1, 2 workers: flat groups never reach the buffer, their slots go to new prompts,
    every step trains 4 groups with spread and within the staleness bound, and each drawn prompt is
    trained, filtered or outstanding exactly once."""
    from cluster.pipeline.run import Run

    eta = 1
    cfg, flat = _dyn_cfg(
        demo_assets,
        tmp_path,
        4,
        48,
        **{
            "pipeline.mode": "async",
            "pipeline.max_staleness": eta,
            "learner.off_policy": "tis",
            "rollout.num_workers": 2,
        },
    )
    trainer = Run(cfg, tmp_path / "run")
    batches = []
    try:
        start_train = trainer.pipeline.start_train

        def spy(taken):
            batches.append(_groups_of(taken.parts))
            return start_train(taken)

        trainer.pipeline.start_train = spy
        rows = [trainer.iteration() for _ in range(4)]
        outstanding = trainer.pipeline.buffer.outstanding()
        pulled = trainer.pipeline.buffer.pulled
    finally:
        trainer.close()
    assert len(batches) == 4
    for groups in batches:
        assert len(groups) == 4 and not set(groups) & flat
        assert all(np.std(rs) > 0 for rs in groups.values())
    for m in rows:
        assert m["dynamic/shortfall_groups"] == 0 and m["staleness/max"] <= eta
        assert m["dynamic/extra_prompts"] == m["dynamic/filtered_groups"]
    assert (
        sum(m["dynamic/filtered_groups"] for m in rows)
        == trainer.progress.filtered_total
        == len(trainer.progress.filtered_prompts)
    )
    assert set(trainer.progress.filtered_prompts) <= flat and set(
        trainer.progress.filtered_prompts.values()
    ) == {1}
    assert (
        trainer.progress.filtered_total >= 4
    )  # 16 informative prompts trained: at least 24 drawn, 8 of them flat
    assert (
        set(trainer.progress.trained_prompts.values()) == {1} and len(trainer.progress.trained_prompts) == 16
    )
    # one epoch of 48 in order, not wrapped: the drawn prompts are 0 .. pulled-1, each in exactly one place
    assert pulled < 48
    ends = [*trainer.progress.trained_prompts, *trainer.progress.filtered_prompts, *outstanding]
    assert sorted(ends) == list(range(pulled))
    # what the rule implies: every flat prompt drawn and scored is filtered
    assert set(trainer.progress.filtered_prompts) == flat & set(range(pulled)) - set(outstanding)


@pytest.mark.slow
def test_async_short_batch_given_back_at_zero_staleness_is_trained(ray_local, demo_assets, tmp_path):
    """Async, max_staleness 0, max_rounds 1, every third prompt flat: step 1's batch is short (the
    round limit reached with flat groups among the first 4). Its first chunk's objects are reported
    lost by the learner (`LostInputs`, as tests/test_operations.py does for sync: no rank trains), so
    the batch is handed back to the buffer. The step then regenerates that chunk and trains: before,
    the give-back kept the short batch's slots used and the filtered count reset, so at eta 0 nothing
    could be admitted or taken and the driver polled for ever (now its idle deadline would end it in a
    WaitTimeout: timeouts.generate_s is small here, so either way the test ends)."""
    import ray

    from cluster.pipeline.run import Run

    P = 4
    cfg, flat = _dyn_cfg(
        demo_assets,
        tmp_path,
        2,
        24,
        **{
            "pipeline.mode": "async",
            "pipeline.max_staleness": 0,
            "data.dynamic_sampling.max_rounds": 1,
            "timeouts.generate_s": 30,
        },
    )
    trainer = Run(cfg, tmp_path / "run")
    lost, batches = [], []
    try:
        real = trainer.learner.train_calls

        def lose_first_chunk_once(parts):
            batches.append(sorted(c.facts[j].prompt_index for c, pos in parts for j in pos))
            if lost:
                return real(parts)
            lost.append(parts[0][0].index)
            return [("learner-rank-0", ray.put(LostInputs([0])), [parts[0][0]])]  # no rank trains

        trainer.learner.train_calls = lose_first_chunk_once
        rows = [trainer.iteration() for _ in range(2)]
        outstanding = trainer.pipeline.buffer.outstanding()
        pulled = trainer.pipeline.buffer.pulled
    finally:
        trainer.close()
    assert len(lost) == 1 and len(batches) == 3  # step 1 taken twice (given back once), step 2 once
    assert len(set(batches[0])) < P and not set(batches[0]) & flat  # a short batch, lost, given back
    assert set(batches[0]) <= set(trainer.progress.trained_prompts)  # its groups trained after all
    assert rows[0]["faults/lost_chunks"] == 1 and rows[0]["dynamic/shortfall_groups"] > 0
    assert rows[0]["dynamic/filtered_groups"] >= 1  # counted once, in the step that trained
    assert set(trainer.progress.trained_prompts.values()) == {1}
    assert set(trainer.progress.filtered_prompts.values()) == {1}
    ends = [*trainer.progress.trained_prompts, *trainer.progress.filtered_prompts, *outstanding]
    assert sorted(ends) == list(range(pulled))  # each drawn prompt in exactly one place
