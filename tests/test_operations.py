"""Operating a run: exact resume, a learner rank dying, actors dying or stuck, live scaling, bad rewards.

All on the real local Ray with the real demo models; every test drives a `Run` step by step.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray
from demo_run import CONFIG, SMALL_STEPS, demo_overrides

from cluster.config.schema import load_config
from cluster.pipeline.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from cluster.pipeline.control import control_name
from cluster.pipeline.failures import RewardFailureError
from cluster.pipeline.learner_calls import LearnerStepError
from cluster.pipeline.run import Run
from cluster.records.groups import LostInputs
from cluster.scale import main as scale_main

pytestmark = pytest.mark.slow

COMPARED = [
    "rollout/reward_mean",
    "rollout/response_length",
    "loss/policy",
    "loss/value",
    "objective/kl",
    "params/grad_norm",
]


def small(assets, steps, **extra):
    return load_config(CONFIG, demo_overrides(assets, steps, **{**SMALL_STEPS, **extra}))


def run_steps(trainer: Run, n: int) -> list[dict]:
    return [trainer.iteration() for _ in range(n)]


EVERY_2 = {"checkpoint.every_steps": 2}


def test_a_set_up_that_fails_part_way_stops_what_it_started(ray_local, demo_assets, tmp_path):
    """`Run` is complete after its constructor or not at all: a set-up that fails once its actors are up
    (resuming from a folder that is no checkpoint, read after the roles, the learner ranks and the control
    actor started) stops every actor it started before the error reaches the caller."""
    from ray._private.state import actors

    not_a_checkpoint = tmp_path / "not-a-checkpoint"
    not_a_checkpoint.mkdir()
    run_id = f"half-{tmp_path.name}"  # the run folder's name: its actors' names start with it
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        Run(small(demo_assets, 2), tmp_path / run_id, resume_from=not_a_checkpoint)

    def of_the_run() -> dict[str, str]:
        return {
            a["Name"]: a["State"]
            for a in actors().values()
            if a["Name"].startswith(f"{run_id}/") or a["Name"] == control_name(run_id)
        }

    started = of_the_run()
    assert control_name(run_id) in started and any(n.startswith(f"{run_id}/") for n in started), started
    deadline = time.monotonic() + 120  # ray.kill returns before GCS records the death
    while (
        alive := [n for n, state in of_the_run().items() if state != "DEAD"]
    ) and time.monotonic() < deadline:
        time.sleep(1)
    assert not alive, f"actors of the half-started run still alive: {alive}"


@pytest.fixture(scope="module")
def straight(ray_local, demo_assets, tmp_path_factory) -> list[dict]:
    """4 steps of a run that loses nothing: what the faulted runs below must reproduce."""
    reference = Run(small(demo_assets, 4, **EVERY_2), tmp_path_factory.mktemp("straight") / "run")
    try:
        return run_steps(reference, 4)
    finally:
        reference.close()


def test_resume_after_learner_death_continues_the_same_run(ray_local, demo_assets, tmp_path, straight):
    # A run that checkpoints at step 2, then loses its learner rank in step 3.
    crashed = Run(small(demo_assets, 4, **EVERY_2), tmp_path / "crashed")
    try:
        run_steps(crashed, 2)
        ray.kill(crashed.roles.ranks[0], no_restart=True)
        with pytest.raises(LearnerStepError, match=r"learner-rank-0 died during step 3.*--resume"):
            crashed.iteration()
    finally:
        crashed.close()
    ckpt = latest_checkpoint(tmp_path / "crashed")
    assert ckpt.name == "step-000002"

    resumed = Run(small(demo_assets, 4, **EVERY_2), tmp_path / "crashed", resume_from=ckpt)
    try:
        assert resumed.step == 2 and resumed.version == 2
        versions = ray.get([w.version.remote() for w in resumed.roles.workers.handles], timeout=60)
        assert versions == [2]
        after = run_steps(resumed, 2)
    finally:
        resumed.close()
    for want, got in zip(straight[2:], after, strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    rows = [json.loads(x) for x in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_dead_and_stuck_actors_are_replaced_and_every_prompt_trained_once(ray_local, demo_assets, tmp_path):
    prompts = [json.loads(x) for x in demo_assets.prompts.read_text().splitlines()[:24]]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    cfg = small(
        demo_assets,
        3,
        **{
            "data.prompts_path": path,
            "rollout.num_workers": 2,
            "rollout.num_cpus_per_worker": 0.25,
            "rollout.chunk_size": 2,
            "timeouts.generate_s": 6,
        },
    )

    def die_at_the_next_load(worker) -> None:  # run in a rollout worker's process (shipped by value)
        """From now on this worker's process exits as it swaps in a weight bundle: lost mid-push. Set on
        the actor's own class: Ray's wrapper class holds its own copy of each method."""
        import os

        type(worker)._swap = lambda *args, **kwargs: os._exit(1)

    trainer = Run(cfg, tmp_path / "run")
    try:
        # Step 1: a rollout worker dies inside the push of v1 (its process exits as it loads the
        # bundle): the push names it lost and the run replaces it; the replacement loads v1 before it
        # samples. By construction, not by timing: the worker dies in that call whatever the speed.
        ray.get(trainer.roles.workers.handles[0].__ray_call__.remote(die_at_the_next_load), timeout=60)
        m1 = trainer.iteration()
        assert m1["faults/actor_replacements"] == 1
        assert trainer.roles.workers.names[0].endswith(".r1")
        assert ray.get(trainer.roles.workers.handles[0].version.remote(), timeout=60) == 1
        # Step 2: a rollout worker is killed while chunks are queued on it. It is busy first (calls
        # of one caller run in order), so step 2 cannot end before the kill whatever the machine's
        # speed: its chunks wait behind the busy call until the kill (or, were the kill to come
        # before the step's first dispatch, they find it dead); both are its replacement in step 2.
        victim = trainer.roles.workers.handles[0]
        victim.__ray_call__.remote(lambda self: time.sleep(120))
        threading.Timer(0.2, lambda: ray.kill(victim, no_restart=True)).start()
        m2 = trainer.iteration()
        # Step 3: a worker is stuck (busy far past timeouts.generate_s) and the reference dies.
        trainer.roles.workers.handles[1].__ray_call__.remote(lambda self: time.sleep(120))
        ray.kill(trainer.roles.references.handles[0], no_restart=True)
        t0 = time.monotonic()
        m3 = trainer.iteration()
        assert time.monotonic() - t0 < 90
        names = trainer.roles.workers.names + trainer.roles.references.names
        versions = ray.get([w.version.remote() for w in trainer.roles.workers.handles], timeout=60)
    finally:
        trainer.close()
    assert m2["faults/actor_replacements"] >= 1 and m3["faults/actor_replacements"] >= 2
    assert any(".r" in n for n in names)
    assert versions == [3, 3]
    # One epoch of 24 prompts in 3 steps of 8: each prompt trained on exactly once.
    assert sorted(trainer.progress.trained_prompts) == sorted(p.index for p in trainer.prompts)
    assert set(trainer.progress.trained_prompts.values()) == {1}


def test_a_lost_learner_input_is_generated_again_with_the_same_seed(
    ray_local, demo_assets, tmp_path, straight
):
    """Sync mode: the ranks report an input whose object is gone (`LostInputs`: its only copy died
    with its node, as tests/test_multinode.py does for real in async mode), so no rank trained; the
    driver generates and scores that chunk again, same seed and weights, and retries the step: the
    numbers of a run that lost nothing (step 1 of the same config), the loss counted."""
    want = straight[0]
    trainer = Run(small(demo_assets, 4, **EVERY_2), tmp_path / "lossy")
    lost = []
    try:
        real = trainer.learner.train_calls

        def lose_first_chunk_once(parts, engines_hold):
            if lost:
                return real(parts, engines_hold)
            lost.append((parts[0][0], parts[0][0].samples_ref))
            return [("learner-rank-0", ray.put(LostInputs([0])), [parts[0][0]])]  # no rank trains

        trainer.learner.train_calls = lose_first_chunk_once
        got = trainer.iteration()
    finally:
        trainer.close()
    ((chunk, old_samples),) = lost
    assert chunk.round == 1 and chunk.samples_ref != old_samples  # generated again
    assert got["faults/lost_chunks"] == 1 and want["faults/lost_chunks"] == 0
    for key in [*COMPARED, "rollout/samples"]:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert (
        set(trainer.progress.trained_prompts.values()) == {1} and len(trainer.progress.trained_prompts) == 8
    )


def test_scale_rollout_workers_of_a_live_run(ray_local, demo_assets, tmp_path):
    trainer = Run(small(demo_assets, 5), tmp_path / "run")
    try:
        trainer.iteration()
        # Scaled from outside while step 2 runs: applied at the next step boundary.
        request = threading.Thread(target=scale_main, args=(["--run", trainer.run_id, "rollout=3"],))
        request.start()
        trainer.iteration()
        request.join(timeout=60)
        m3 = trainer.iteration()
        assert m3["scale/rollout_workers"] == 3
        versions = ray.get([w.version.remote() for w in trainer.roles.workers.handles], timeout=60)
        assert versions == [3, 3, 3]
        assert scale_main(["--run", trainer.run_id, "rollout=2"]) == 0
        m4 = trainer.iteration()
        assert m4["scale/rollout_workers"] == 2 and len(trainer.roles.workers) == 2
        assert ray.get([w.version.remote() for w in trainer.roles.workers.handles], timeout=60) == [4, 4]
    finally:
        trainer.close()
    assert scale_main(["--run", "no-such-run", "rollout=2"]) == 2
    assert scale_main(["--run", "x", "learner=2"]) == 2


FLAKY_RULE = """
import math
from reward_service.rules import register_reward

@register_reward("flaky_positive")
def flaky_positive(prompt, response, meta):
    words = response.split()
    if len(words) % 3 == 0:
        raise RuntimeError("judge crashed")
    if len(words) % 3 == 1:
        return math.nan
    return float("good" in words or "great" in words)
"""


def test_failing_rewards_are_dropped_counted_and_abort_past_the_threshold(ray_local, demo_assets, tmp_path):
    module = tmp_path / "flaky_rule.py"
    module.write_text(FLAKY_RULE)
    extra = {
        "reward.kind": "rule",
        "reward.rule": "flaky_positive",
        "reward.rule_module": module,
        # The demo's colocated placement (one actor): reward failures are the scorer's rule, the same
        # code in either placement; a scorer actor that dies is tested above.
        "cluster.placement": "colocated",
    }
    trainer = Run(small(demo_assets, 2, **{**extra, "reward.max_failure_frac": 0.95}), tmp_path / "ok")
    try:
        m = trainer.iteration()
    finally:
        trainer.close()
    assert m["rollout/reward_failures"] > 0
    assert m["rollout/samples"] + m["rollout/reward_failures"] == 8
    assert m["rollout/samples"] > 0 and m["policy_version"] == 1

    strict = Run(small(demo_assets, 2, **{**extra, "reward.max_failure_frac": 0.0}), tmp_path / "strict")
    try:
        with pytest.raises(RewardFailureError, match="judge crashed|not finite|NaN"):
            strict.iteration()
        assert strict.version == 0  # nothing was trained on a step that aborted
    finally:
        strict.close()
    assert not list_checkpoints(tmp_path / "strict")
