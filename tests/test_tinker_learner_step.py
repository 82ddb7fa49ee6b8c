"""A Tinker tenant's `forward_backward` + `optim_step` against the project's learner step on one batch
(issue 60): `importance_sampling` and `ppo` through `cluster.serve.tenant.TenantModel` (the learner's
DeepSpeed ZeRO-2 engine over the LoRA policy) and `LearnerRank.train_step` with the config that is the
same surrogate (tests/tinker_learner_step.py says which, and how the normalisations meet), two
optimizer steps from the same base weights and LoRA seed, in a process of their own; under ZeRO-2 (the
learner's default) and ZeRO-3 (serve config `zero_stage`), learner and tenant alike.

What must agree (<= 1e-5): every adapter weight after the two steps, and each step's global gradient
norm before the clip. The norms are the check on the loss's scale: the clip (0.5, below the norms) and
Adam each divide a gradient's scale out of the update, so the weights alone would not see a loss
normalised by another count. The tenant's first step comes as two forward_backward calls on halves
of the batch, so DeepSpeed's accumulation across calls is in the comparison too. And a tenant that
loads another's state with its optimizer, a forward_backward of its own pending, then takes the same
step as the other lands on the other's adapter bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-5


def run_both(model_dir: Path, loss: str, stage: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.tinker_learner_step", str(model_dir), loss, str(stage)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
@pytest.mark.parametrize(("loss", "stage"), [("importance_sampling", 2), ("ppo", 2), ("ppo", 3)])
def test_tinker_step_equals_the_learner_step(tiny_policy_dir, loss, stage):
    r = run_both(tiny_policy_dir, loss, stage)
    assert r["optimizer"] == {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}[stage]
    assert r["names"] and r["same_start"] == 0.0  # the same adapter, the same LoRA init
    assert r["learner_steps"] == [1.0, 1.0]  # both learner steps were applied
    assert r["nonzero_advantages"] > 10
    assert r["moved"] > 1e-3  # two steps at lr 1e-2 move the adapter by ~2e-2
    assert r["max_diff"] <= TOL, r
    for a, b in zip(r["learner_grad_norms"], r["tinker_grad_norms"], strict=True):
        assert a > 0.5 and abs(a - b) <= TOL * a, r  # above grad_clip_norm: the clip acted in both
    if loss == "ppo":
        assert min(r["clip_frac"]) > 0.05, r  # some ratios left [0.8, 1.2]: the clip branch is compared
    else:
        assert r["clip_frac"] == [0.0, 0.0], r
    # the resumed tenant: its pending gradients dropped, the adapter and AdamW state loaded exactly
    assert r["resumed_steps"] == [3, 3] and r["resumed_moved"] > 1e-3
    assert r["resumed_diff"] == 0.0, r
