"""The calculator demo through the real pipeline: a few PPO steps on multi-turn tool-using episodes with
the shipped config (chat prompts from parquet rendered by the policy's ChatML template, Hermes tool
calls, tool messages rendered by the same template, colocated, the environment's reward), held-out
evaluation on problems the run never trains on, and the transcripts printed before and after."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from demos.calculator import AssetPaths, ensure_assets

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "calculator_tiny.yaml"


@pytest.fixture(scope="module")
def calculator_assets(tmp_path_factory) -> AssetPaths:
    """A quick build (few pretraining steps: the mechanics, not the accuracy, are under test)."""
    return ensure_assets(
        tmp_path_factory.mktemp("demo") / "calculator_tiny", lm_steps=30, check_band=False, quiet=True
    )


def _overrides(assets: AssetPaths, steps: int, **extra) -> list[str]:
    sets = {
        "model.policy_path": assets.policy,
        "model.demo_assets": None,
        "data.prompts_path": assets.prompts,
        "eval.prompts_path": assets.eval_prompts,
        "eval.max_prompts": 16,
        "eval.every_steps": 1,
        "data.prompts_per_step": 8,  # x 4 episodes (the config's RLOO group): 32 a step
        "rollout.chunk_size": 16,
        "learner.micro_batch_size": 16,
        "run.steps": steps,
        "run.progress_bar": False,
        "run.loggers": "[jsonl,prometheus]",
        "cluster.dashboard": False,
        **extra,
    }
    return [f"{k}={'null' if v is None else v}" for k, v in sets.items()]


@pytest.mark.slow
def test_a_few_steps_on_tool_using_episodes(ray_local, calculator_assets, tmp_path, capsys):
    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run
    from cluster.reporting.metrics import read_metrics

    cfg = load_config(CONFIG, _overrides(calculator_assets, 2))
    trainer = Run(cfg, tmp_path / "run")
    try:
        summary = trainer.train()
        _metrics, batch = trainer.evaluator.evaluate()
        samples = [s for c in batch.chunks for s in ray_local.get(c.samples_ref)]
    finally:
        trainer.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 2]  # held-out before, steps 1-2, held-out after
    assert "eval/env/turns" in rows[3] and "env/episodes" not in rows[3]
    for r in rows[1:3]:
        assert r["env/episodes"] == 32 and r["env/failures"] == 0
        assert 1.0 <= r["env/turns"] <= 3.0 and "env/tool_calls_rate" in r
        assert r["env/status/done"] + r["env/status/max_turns"] + r["env/status/max_tokens"] == 32
    assert "eval/env/turns" in rows[0] and 0.0 <= rows[0]["eval/accuracy"] <= 1.0
    train = {r["messages"][0]["content"] for r in pq.read_table(calculator_assets.prompts).to_pylist()}
    tok = trainer.tokenizer
    for s in samples:  # held-out episodes: transcripts whose observations are the calculator's answers
        prompt = tok.decode(s.prompt_ids)
        assert prompt.startswith("<|im_start|>user\n") and prompt.endswith(
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        assert prompt.split("\n")[1].removesuffix("<|im_end|>") not in train
        text = tok.decode(s.response_ids, skip_special_tokens=True)
        mask = s.episode.loss_mask
        observed = tok.decode(s.response_ids[mask == 0])
        # one tool message after each tool call, rendered by the template and never trained on
        assert observed.count("<|im_start|>tool\n") == s.episode.turns - 1
        assert text.count("<tool_call>") >= s.episode.turns - 1
    out = capsys.readouterr().out
    assert "held-out prompts before training" in out and "held-out prompts after training" in out
    assert "] <|im_start|>user\\n" in out  # samples printed with their role markers, one line each
    assert any(line.startswith("held-out (16 prompts): reward_mean") for line in summary.lines())
