"""`cluster.export` refuses what it cannot export, naming the folder and the reason (its round trip
against the learner's own `final/` runs in tests/test_graceful_stop.py, on a real run's checkpoint)."""

from __future__ import annotations

import json
import math

import pytest

from cluster.export import ExportError, export, main
from learner.consolidated_checkpoint import read_weights


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    (ckpt / "learner").mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"format": 1, "step": 3}))
    with pytest.raises(ExportError, match="incomplete checkpoint"):
        export(ckpt, tmp_path / "out")
    assert main([str(ckpt), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_an_unknown_dtype_is_refused_with_the_choices(tmp_path):
    with pytest.raises(
        ExportError, match=r"--dtype 'int8': expected one of \['float32', 'bfloat16', 'float16'\]"
    ):
        export(tmp_path, tmp_path / "out", dtype="int8")


def test_a_deepspeed_format_learner_folder_is_refused_by_name(tmp_path):
    (tmp_path / "global_step3").mkdir()
    with pytest.raises(
        ValueError, match="not a consolidated learner checkpoint.*checkpoint_format: deepspeed"
    ):
        read_weights(tmp_path, "policy.")


def test_evaluate_without_held_out_prompts_exits_2_before_ray(
    tmp_path, tiny_policy_dir, tiny_reward_dir, capsys
):
    from types import SimpleNamespace

    from demo_run import CONFIG, demo_overrides

    from cluster.evaluate import main as evaluate_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the movie was"}\n')
    tiny = SimpleNamespace(policy=tiny_policy_dir, prompts=prompts, reward=tiny_reward_dir)
    sets = sum((["--set", s] for s in demo_overrides(tiny, 2)), [])
    assert evaluate_main([str(CONFIG), "--policy", str(tiny_policy_dir), *sets]) == 2
    assert "eval.prompts_path: no held-out prompts" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluate_scores_the_initial_policy_as_a_run_scores_it_before_training(
    ray_local, demo_assets, tmp_path
):
    """`cluster.evaluate` on a run's config and its initial policy gives the held-out metrics the
    run's own evaluator gives before any step (same roles, sampling and chunk seeds), reward by reward."""
    from demo_run import CONFIG, demo_overrides, prompt_file

    from cluster.config.schema import load_config
    from cluster.evaluate import main as evaluate_main
    from cluster.pipeline.run import Run

    extra = {
        "eval.prompts_path": demo_assets.eval_prompts,
        "eval.max_prompts": 8,
        "data.prompts_path": prompt_file(demo_assets, tmp_path, 8),
        "cluster.placement": "colocated",
        "rollout.chunk_size": 4,
    }
    cfg = load_config(CONFIG, demo_overrides(demo_assets, 2, **extra))
    trainer = Run(cfg, tmp_path / "run")
    try:
        before, _ = trainer.evaluator.evaluate()
    finally:
        trainer.close()
    out = tmp_path / "report.json"
    args = [str(tmp_path / "run" / "config.yaml"), "--policy", str(demo_assets.policy)]
    assert evaluate_main([*args, "--run-dir", str(tmp_path / "eval"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == 8 and report["placement"] == "colocated"
    got = report["metrics"]
    keys = [k for k in before if k.startswith("eval/") and k != "eval/requested_at_step"]
    assert "eval/reward_mean" in keys
    for k in keys:
        if math.isnan(before[k]):
            assert got[k] is None, k  # JSON writes a metric without a value as null
        else:
            assert got[k] == pytest.approx(before[k], abs=1e-9), k
