"""The LR schedule over a run (learner.lr_schedule): factors worked by hand, the clock of optimizer-step
slots (taken, skipped or empty alike) through `ppo_update`, the length the cluster fills in, the
scheduler's state through both checkpoint formats' serialisations and pickling, and config errors."""

from __future__ import annotations

import io
import json
import math
import pickle
from typing import get_args

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from cluster.config.schema import ConfigError, build_config
from learner.config import LearnerConfig
from learner.lr_schedule import build_scheduler, lr_factor
from learner.registry import SCHEDULES
from learner.safe_checkpoint import safe_torch_load

BASE = {"model": {"policy_path": "p"}, "data": {"prompts_path": "x.jsonl"}, "reward": {"model_path": "r"}}


def _factors(config: LearnerConfig, n: int) -> list[float]:
    f = lr_factor(config)
    return [f(k) for k in range(n)]


def _optimizer(lr: float = 1.0, value_lr: float | None = None) -> torch.optim.Optimizer:
    """An AdamW with one group, or two (policy, value head) as build_optimizer makes with value_lr."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    if value_lr is not None:
        groups.append({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": value_lr})
    return torch.optim.AdamW(groups, lr=lr)


def _lrs(scheduler, steps: int) -> list[list[float]]:
    """Each slot's rates (all groups): the rate slot k trains at, then the optimizer and schedule step."""
    out = []
    for _ in range(steps):
        out.append(list(scheduler.get_last_lr()))
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_the_registry_is_the_config_choice():
    assert set(SCHEDULES.names()) == set(get_args(LearnerConfig.model_fields["lr_schedule"].annotation))
    assert LearnerConfig().lr_schedule == "constant" and LearnerConfig().min_lr_ratio == 0.1


@pytest.mark.parametrize("warmup", [0, 1, 4, 10])
def test_constant_is_the_previous_warm_up_bit_for_bit(warmup):
    """Before schedules the factor was `1.0 if W <= 0 else min(1.0, (k + 1) / W)` (LinearWarmup)."""
    old = [1.0 if warmup <= 0 else min(1.0, (k + 1) / warmup) for k in range(30)]
    assert _factors(LearnerConfig(warmup_steps=warmup), 30) == old  # exact floats
    if warmup == 4:
        assert old[:6] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # constant needs no length and ignores min_lr_ratio
    assert _factors(LearnerConfig(warmup_steps=warmup, min_lr_ratio=0.5, lr_schedule_steps=12), 30) == old


def test_linear_and_cosine_by_hand():
    """W = 2 warm-up slots, T = 10, floor r = 0.1: p = (k - 2) / 8 after the warm-up."""
    kw = {"warmup_steps": 2, "lr_schedule_steps": 10, "min_lr_ratio": 0.1}
    lin = _factors(LearnerConfig(lr_schedule="linear", **kw), 16)
    cos = _factors(LearnerConfig(lr_schedule="cosine", **kw), 16)
    c45 = math.sqrt(2) / 2  # cos(pi/4) = -cos(3 pi/4)
    expected = {
        0: (0.5, 0.5),  # warm-up (k + 1) / W
        1: (1.0, 1.0),
        2: (1.0, 1.0),  # p = 0
        4: (0.1 + 0.9 * 0.75, 0.1 + 0.9 * (1 + c45) / 2),  # p = 1/4: 0.775, 0.868198
        6: (0.55, 0.55),  # p = 1/2, the midpoint: min + (1 - min) / 2 for both
        8: (0.1 + 0.9 * 0.25, 0.1 + 0.9 * (1 - c45) / 2),  # p = 3/4: 0.325, 0.231802
        9: (0.1 + 0.9 * 0.125, 0.1 + 0.9 * (1 + math.cos(7 * math.pi / 8)) / 2),  # the run's last slot
        10: (0.1, 0.1),  # T: the floor
        15: (0.1, 0.1),  # past T it stays there
    }
    for k, (want_lin, want_cos) in expected.items():
        assert lin[k] == pytest.approx(want_lin, rel=1e-12, abs=1e-15), k
        assert cos[k] == pytest.approx(want_cos, rel=1e-12, abs=1e-15), k
    assert all(a >= b for a, b in zip(lin[1:], lin[2:], strict=False))  # never rising after the warm-up
    assert all(a >= b for a, b in zip(cos[1:], cos[2:], strict=False))
    # no floor: linear ends at 0, half-way at 1/2
    lin0 = _factors(LearnerConfig(lr_schedule="linear", lr_schedule_steps=10, min_lr_ratio=0.0), 12)
    assert lin0[5] == pytest.approx(0.5) and lin0[10] == lin0[11] == 0.0 and lin0[0] == 1.0


def test_the_scheduler_scales_every_group_by_the_factor():
    config = LearnerConfig(
        lr=3e-4, value_lr=1e-3, lr_schedule="cosine", lr_schedule_steps=8, min_lr_ratio=0.2
    )
    lrs = _lrs(build_scheduler(_optimizer(3e-4, 1e-3), config), 9)
    f = _factors(config, 9)
    for k in range(9):
        assert lrs[k] == pytest.approx([3e-4 * f[k], 1e-3 * f[k]], rel=1e-12)
    assert lrs[4][0] == pytest.approx(3e-4 * (0.2 + 0.8 * 0.5))  # the midpoint (no warm-up)


def test_the_run_fills_in_its_length_in_optimizer_steps():
    """lr_schedule_steps = run.steps x ppo_epochs x num_minibatches, unless set (in the resolved record)."""
    learner = {"ppo_epochs": 2, "num_minibatches": 3, "lr_schedule": "cosine", "warmup_steps": 5}
    run = {"run": {"steps": 7}, "data": {**BASE["data"], "prompts_per_step": 8}}
    cfg = build_config({**BASE, **run, "learner": learner})
    assert cfg.resolved.lr_schedule_steps == cfg.resolved.learner.lr_schedule_steps == 7 * 2 * 3
    assert cfg.learner.lr_schedule_steps is None  # the config keeps what was written
    assert build_config({**BASE, **run}).resolved.lr_schedule_steps == 7  # constant: filled in too
    kept = build_config({**BASE, **run, "learner": {**learner, "lr_schedule_steps": 100}})
    assert kept.resolved.lr_schedule_steps == 100  # e.g. a run to be extended on resume
    with pytest.raises(ConfigError) as info:
        build_config({**BASE, **run, "learner": {**learner, "warmup_steps": 42}})
    msg = str(info.value)
    assert "learner.warmup_steps=42 must be less than the run's 42 optimizer steps" in msg
    assert "7 x 2 x 3" in msg
    # constant: a warm-up as long as the run is allowed, as before
    ok = build_config({**BASE, **run, "learner": {"warmup_steps": 50}})
    assert ok.resolved.lr_schedule_steps == 7


def test_config_errors_name_the_field_and_the_allowed_values():
    with pytest.raises(ConfigError) as info:
        build_config({**BASE, "learner": {"lr_schedule": "exponential"}})
    msg = str(info.value)
    assert "learner.lr_schedule" in msg and "'constant', 'linear' or 'cosine'" in msg and "exponential" in msg
    for bad, bound in ((1.5, "less than or equal to 1"), (-0.1, "greater than or equal to 0")):
        with pytest.raises(ConfigError, match=rf"learner\.min_lr_ratio: Input should be {bound}"):
            build_config({**BASE, "learner": {"min_lr_ratio": bad}})
    with pytest.raises(
        ConfigError, match=r"learner\.lr_schedule_steps: Input should be greater than or equal to 1"
    ):
        build_config({**BASE, "learner": {"lr_schedule_steps": 0}})
    # a learner used alone: the length it needs, and a warm-up shorter than it
    with pytest.raises(
        ValidationError, match=r"learner\.warmup_steps=10 must be less than learner\.lr_schedule_steps=10"
    ):
        LearnerConfig(lr_schedule="linear", warmup_steps=10, lr_schedule_steps=10)
    with pytest.raises(ValueError, match=r"learner\.lr_schedule='cosine' needs learner\.lr_schedule_steps"):
        build_scheduler(_optimizer(), LearnerConfig(lr_schedule="cosine"))


def test_the_state_survives_both_checkpoint_formats_and_pickling():
    """Consolidated: JSON in learner_index.json; DeepSpeed: torch.save read weights-only; Ray: pickle.
    A scheduler rebuilt from the config and loaded with the state goes on where the first one was."""
    config = LearnerConfig(lr=1e-3, value_lr=5e-3, lr_schedule="cosine", warmup_steps=3, lr_schedule_steps=20)
    first = build_scheduler(_optimizer(1e-3, 5e-3), config)
    _lrs(first, 7)
    state = first.state_dict()
    assert state["last_epoch"] == 7 and state["lr_lambdas"] == [{}, {}]  # numbers only, no callable
    from_json = json.loads(json.dumps(state))
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    from_pt = safe_torch_load(buf)
    factor = pickle.loads(pickle.dumps(first.lr_lambdas[0]))
    assert [factor(k) for k in range(25)] == _factors(config, 25)
    assert pickle.loads(pickle.dumps(config)) == config

    ahead = _lrs(first, 13)
    for loaded in (from_json, from_pt):
        resumed = build_scheduler(_optimizer(1e-3, 5e-3), config)
        resumed.load_state_dict(loaded)
        assert resumed.get_last_lr() == ahead[0]  # the same arithmetic: equal floats
        assert _lrs(resumed, 13) == ahead

    # A checkpoint from before schedules (LinearWarmup kept its warmup_steps in the state) still loads.
    old = build_scheduler(_optimizer(), LearnerConfig(warmup_steps=10))
    old.load_state_dict({**old.state_dict(), "last_epoch": 4, "lr_lambdas": [{"warmup_steps": 10}]})
    old.optimizer.step()
    old.step()
    assert old.get_last_lr() == [pytest.approx(0.6)]  # slot 5 of a 10-slot warm-up


# ---------------------------------------------------------------- the clock through ppo_update


def _trajectories(n: int, seed: int, truncated: bool = False):
    from learner.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        r = rng.integers(4, 28, size=int(rng.integers(1, 5)))
        out.append(
            Trajectory(
                prompt_ids=rng.integers(4, 28, size=3),
                response_ids=r,
                behaviour_logprobs=rng.normal(-3.3, 0.2, len(r)).astype(np.float32),
                ref_logprobs=rng.normal(-3.3, 0.2, len(r)).astype(np.float32),
                score=float(rng.normal()),
                truncated=truncated,
            )
        )
    return out


@pytest.mark.parametrize("case", ["applied", "skipped", "empty"])
def test_every_minibatch_moves_the_clock_taken_or_not(tiny_policy_dir, case):
    """2 epochs x 2 minibatches: 4 slots per PPO step whether DeepSpeed applies each step (and steps
    the schedule itself), skips it, or the learner has no token to train; train/lr is the rate of
    the step's first slot, lr x factor(s x 4) at PPO step s."""
    from test_learner_packing import GradientTap

    from learner.batch import pack_trajectories
    from learner.context import LearnerContext
    from learner.model import PolicyWithValueHead
    from learner.ppo_step import ppo_update
    from learner.prepare import prepare

    torch.manual_seed(0)
    config = LearnerConfig(
        lr=2e-3,
        ppo_epochs=2,
        num_minibatches=2,
        micro_batch_size=2,
        lr_schedule="linear",
        warmup_steps=1,
        lr_schedule_steps=9,
        min_lr_ratio=0.0,
        overlong={"filter": case == "empty"},
    )
    scheduler = build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr), config)
    tap = GradientTap(PolicyWithValueHead.from_pretrained(tiny_policy_dir), case == "applied", scheduler)
    seen = []
    for step in range(3):
        batch = pack_trajectories(_trajectories(6, seed=step, truncated=case == "empty"), pad_id=0)
        prepare(LearnerContext(tap, config, 1.0, 0), batch, 0.1)
        m = ppo_update(LearnerContext(tap, config, 1.0, 0, torch.Generator().manual_seed(3)), batch)
        assert (m["train/optimizer_steps"], m["train/skipped_steps"]) == {
            "applied": (4.0, 0.0),
            "skipped": (0.0, 4.0),
            "empty": (0.0, 0.0),
        }[case]
        assert scheduler.last_epoch == 4 * (step + 1)
        seen.append(m["train/lr"])
    # slots 0, 4, 8 of W = 1, T = 9: 1, then 1 - (k - 1) / 8
    assert seen == pytest.approx([2e-3, 2e-3 * (1 - 3 / 8), 2e-3 * (1 - 7 / 8)], rel=1e-12)
