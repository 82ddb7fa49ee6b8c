"""Agent runs through the real pipeline: the user's agent (the calculator demo's black-box agent, and an
OpenAI Agents SDK agent) plays every episode through the workers' gateways, on a real local Ray, with
the quick calculator build; sync colocated and async separate. Checked: every step trains the sessions
of its prompts (n per prompt, from the runners), the tool results are masked, held-out evaluation runs
through the same sessions, and the agent runners are actors of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_demo_calculator import _overrides, calculator_assets  # noqa: F401 (the quick build fixture)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "calculator_agent_tiny.yaml"
SDK_AGENT = Path(__file__).resolve().parent / "agent_files" / "sdk_agent.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("agent", "extra"),
    [
        ("demos/calculator_agent.py:agent", {}),
        (
            f"{SDK_AGENT}:agent",
            {"pipeline.mode": "async", "pipeline.max_staleness": 1, "cluster.placement": "separate"},
        ),
    ],
    ids=["demo-agent-sync-colocated", "agents-sdk-async-separate"],
)
def test_agent_sessions_train_through_the_pipeline(ray_local, calculator_assets, tmp_path, agent, extra):  # noqa: F811
    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run
    from cluster.reporting.metrics import read_metrics

    sets = _overrides(
        calculator_assets,
        2,
        **{
            "agent.function": str(ROOT / agent) if agent.startswith("demos") else agent,
            "agent.num_cpus": 0,
            **extra,
        },
    )
    cfg = load_config(CONFIG, sets)
    trainer = Run(cfg, tmp_path / "run")
    try:
        assert len(trainer.roles.agent_runners) == 1
        ray_local.get(trainer.control.set_target.remote("agent", 2))  # `cluster.scale agent=2`
        trainer.train()
        assert len(trainer.roles.agent_runners) == 2  # grown at the first step, in either placement
        _metrics, batch = trainer.evaluator.evaluate()
        samples = [s for c in batch.chunks for s in ray_local.get(c.samples_ref)]
    finally:
        trainer.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "rollout/samples" in r]
    assert len(steps) == 2 and steps[0]["scale/events"] == 1.0
    for r in steps:
        assert (
            r["env/episodes"] + r["env/failures"] >= 32 - 2
        )  # 8 prompts x 4 sessions (a no-call session yields none)
        assert r["train/sequences"] > 0 and 0.0 <= r["rollout/reward_mean"] <= 1.0
    assert "eval/accuracy" in rows[0]
    tok = trainer.tokenizer
    for s in samples:  # held-out sessions: prompts as the data path renders them, tool results masked
        assert tok.decode(s.prompt_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
        masked = tok.decode(s.response_ids[s.episode.loss_mask == 0])
        assert masked.count("<|im_start|>tool\n") == s.episode.turns - 1


@pytest.mark.slow
def test_an_agent_outside_the_cluster_plays_a_runs_episodes_over_http(ray_local, calculator_assets, tmp_path):  # noqa: F811
    """`agent.runners: external`: no runner actors; the demo's agent runs in a process of its own
    (`python -m agent_runners.external`), finds the gateways in the run folder's gateways.json, claims
    every episode over HTTP, and stops when the run's file says it ended."""
    import os
    import subprocess
    import sys

    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run
    from cluster.reporting.metrics import read_metrics

    cfg = load_config(
        CONFIG, _overrides(calculator_assets, 2, **{"agent.runners": "external", "agent.function": None})
    )
    run_dir = tmp_path / "run"
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent_runners.external", "--gateways", str(run_dir / "gateways.json"),
         "--agent", f"{ROOT / 'demos' / 'calculator_agent.py'}:agent", "--sessions", "32"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    trainer = Run(cfg, run_dir)
    try:
        trainer.train()
        assert trainer.roles.agent_runners == []
    finally:
        trainer.close()
        out, _ = agent.communicate(timeout=180)
    assert agent.returncode == 0 and "stopped: the run ended" in out, out
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "rollout/samples" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["env/episodes"] + r["env/failures"] >= 32 - 2 and r["train/sequences"] > 0
    played = int(out.split("played ")[1].split(" episodes")[0])
    assert played >= 2 * 32  # every training episode (and the held-out ones) was played outside
