"""The Tinker cookbook's own minimal RL loop trains through `cluster.serve`.

Which recipe: `tinker_cookbook/recipes/rl_loop.py` of tinker-cookbook 0.5.8 (the newest the package index
installs: 0.6.1 needs tml-renderers >= 0.4.1, which it lacks), in `.venv-cookbook` (`make test` makes it:
CPU torch first, then the cookbook with its math-rl extra), run unchanged by tests/cookbook_rl.py.

What changed, and only that: the tokenizer is registered locally under the model name
(`register_tokenizer`, the cookbook's hook); the model name is `meta-llama/Llama-3.2-1B` only so that
`model_info` picks its `role_colon` renderer, and the service serves the project's tiny GPT-2 under it;
`base_url` and the loop's sizes are the recipe's own command-line fields; `openai/gsm8k` is read from a
local `datasets` cache of one-digit additions in GSM8K's shape (tests/cookbook_assets.py, which also
pretrains the model on the recipe's own prompts: it writes the right sum about 80% of the time but closes
its `\\boxed{` only 20% of the time, so the grader starts at about 0.15 and the loop has the format to learn).

What is asserted: the loop runs to its last step and saves its final checkpoint through the service, and
its own logged `reward/total` (the fraction of sampled answers its grader marks right) rises: the mean of
its last ten steps is above its first five's by 0.1. Measured here (2026-11-29, 2-core CPU, each run with
the SDK's own random sampling seeds), learning rate 0.005 (0.01 is noisier; 0.02 and above collapse the
tiny model within a few Adam steps): build seed 0: first five 0.18, last ten 0.39; seed 1: 0.15 and
0.31 (last five); seed 2: 0.21 and 0.42 (last five); the reward plateaus near 0.45 (the sum is right
about 80% of the time and the box is closed about half the time by then).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from serve_process import REPO, serving

COOKBOOK_PY = REPO / ".venv-cookbook" / "bin" / "python"
KEY, MODEL = "tml-cookbook-key", "meta-llama/Llama-3.2-1B"
STEPS = 40

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not COOKBOOK_PY.exists(), reason="the cookbook's venv .venv-cookbook is missing (make test makes it)"
    ),
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cookbook")
    run = subprocess.run(
        [str(COOKBOOK_PY), str(REPO / "tests" / "cookbook_assets.py"), str(out)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def test_the_cookbook_rl_loop_raises_its_reward_through_the_service(assets, tmp_path):
    config = {
        "api_keys": [KEY],
        "base_models": [{"name": MODEL, "path": str(assets / "policy")}],
        "tenant_cpus": 0.5,
    }
    log = tmp_path / "rl-loop"
    with serving(config, tmp_path) as url:
        env = {
            **os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(assets / "gsm8k"),
        }  # fmt: skip
        args = [
            f"base_url={url}", f"log_path={log}", "batch_size=16", "group_size=8", "learning_rate=0.005",
            "lora_rank=8", "max_tokens=12", "save_every=0", f"max_steps={STEPS}",
        ]  # fmt: skip
        run = subprocess.run(
            [str(COOKBOOK_PY), str(REPO / "tests" / "cookbook_rl.py"), str(assets / "policy"), MODEL, *args],
            capture_output=True, text=True, timeout=1800, env=env,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/total"] for r in rows if "reward/total" in r]
    print("reward/total by step:", [round(r, 3) for r in rewards])
    assert len(rewards) == STEPS
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last > first + 0.1, rewards
    assert (log / "checkpoints.jsonl").exists()  # the recipe's final save_checkpoint went through
