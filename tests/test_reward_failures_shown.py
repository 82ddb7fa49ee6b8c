"""Reward failures below the abort threshold are visible (issue 56, item 8): real runs (Ray, one DeepSpeed
rank, the tests' tiny policy) with reward functions that raise on one kind of row or hang on one row."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from demo_run import CONFIG, demo_overrides

FUNCTIONS = """
import threading

def picky(prompt, response, meta):
    if meta["kind"] == "bad":
        raise ValueError("no rule for rows of kind bad")
    return 1.0

def steady(prompt, response, meta):
    return 0.5

def stall(prompt, response, meta):
    if meta["kind"] == "bad":
        threading.Event().wait()  # never returns
    return 1.0
"""

WORDS = ["the movie was", "i loved it", "the plot is", "a film and", "the acting was", "it is very"]
BAD = {1, 4}  # the rows picky cannot score


def _prompts(path: Path) -> Path:
    rows = [{"prompt": w, "kind": "bad" if i in BAD else "good"} for i, w in enumerate(WORDS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sets(tmp_path: Path, policy: Path, functions: list[str], **extra) -> list[str]:
    module = tmp_path / "functions.py"
    module.write_text(FUNCTIONS)
    tiny = SimpleNamespace(policy=policy, prompts=_prompts(tmp_path / "prompts.jsonl"), reward=None)
    sets = {
        "data.prompts_per_step": len(WORDS),
        "data.shuffle": "false",
        "data.meta_keys": "[kind]",
        "rollout.chunk_size": len(WORDS),
        "rollout.sampling.n": 2,
        "rollout.sampling.max_new_tokens": 4,
        "learner.micro_batch_size": 4,
        "reward.kind": "rule",
        "reward.functions": json.dumps([{"module": f"{module}:{f}"} for f in functions]),
        "cluster.placement": "colocated",
        **extra,
    }
    return demo_overrides(tiny, 1, **sets)


@pytest.mark.slow
def test_failures_are_shown_with_their_row_kept_counted_per_function_and_fail_held_out_accuracy(
    ray_local, tmp_path, tiny_policy_dir, capfd
):
    from cluster.reporting.metrics import read_metrics
    from cluster.train import main

    run_dir = tmp_path / "run"
    held_out = _prompts(tmp_path / "eval.jsonl")
    extra = {"eval.prompts_path": held_out, "eval.samples_per_prompt": 2, "eval.correct_at": 1.0}
    sets = _sets(tmp_path, tiny_policy_dir, ["picky", "steady"], **extra)
    assert main([str(CONFIG), "--run-dir", str(run_dir), *sum((["--set", s] for s in sets), [])]) == 0
    out = capfd.readouterr().out

    failed_per_step = len(BAD) * 2  # two samples of each bad row
    # the console: the first failures, each with its row, its prompt and the function's own message
    shown = [line for line in out.splitlines() if line.startswith("reward failed (")]
    assert len(shown) == 10  # reward_failures.SHOWN, then one line pointing at the file
    assert "further reward failures are not shown (the first 10 are in" in out
    first = shown[0]
    assert first.startswith("reward failed (held-out evaluation before training) on prompt row 1 ")
    assert "'i loved it'" in first and "{'kind': 'bad'}" in first
    assert first.endswith("reward function 'picky' raised ValueError: no rule for rows of kind bad")
    assert any(line.startswith("reward failed (step 1) on prompt row 4 'the acting was'") for line in shown)

    # the run folder keeps the same ten, as records
    kept = [json.loads(line) for line in (run_dir / "reward_failures.jsonl").read_text().splitlines()]
    assert len(kept) == 10
    assert {r["row"] for r in kept} == BAD and {json.dumps(r["meta"]) for r in kept} == {'{"kind": "bad"}'}
    assert {r["error"] for r in kept} == {
        "reward function 'picky' raised ValueError: no rule for rows of kind bad"
    }
    assert [r["when"] for r in kept] == ["held-out evaluation before training"] * 4 + ["step 1"] * 4 + [
        "held-out evaluation after training"
    ] * 2

    rows = read_metrics(run_dir / "metrics.jsonl")
    (train,) = [r for r in rows if "rollout/samples" in r]
    assert train["rollout/reward_failures"] == failed_per_step
    assert train["reward_failures/picky"] == failed_per_step and train["reward_failures/steady"] == 0
    assert train["rollout/samples"] == 2 * len(WORDS) - failed_per_step
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2  # before and after training
    for r in evals:
        # every scored sample is correct (picky gives 1.0): the failed ones are wrong, never left out
        assert r["eval/accuracy"] == (len(WORDS) - len(BAD)) / len(WORDS)
        assert r[f"eval/mean@{2}"] == r["eval/accuracy"]
        assert r["eval/reward_failures"] == failed_per_step == r["eval/reward_failures/picky"]
        assert r["eval/reward_failures/steady"] == 0


@pytest.mark.slow
def test_a_hanging_reward_function_is_named_with_its_row_and_timeout(ray_local, tmp_path, tiny_policy_dir):
    from cluster.config.schema import load_config
    from cluster.pipeline.collector import RolloutError
    from cluster.pipeline.run import Run

    sets = _sets(tmp_path, tiny_policy_dir, ["stall"], **{"reward.function_timeout_s": 3})
    trainer = Run(load_config(CONFIG, sets), tmp_path / "run")
    try:
        with pytest.raises(RolloutError) as err:
            trainer.iteration()
    finally:
        trainer.close()
    message = str(err.value)
    assert (
        "reward function 'stall' did not return within 3 s (reward.function_timeout_s) on prompt row 1 ("
        in (message)
    )
    assert "'i loved it'" in message and "raise reward.function_timeout_s" in message
