"""The learning rate over a run: `learner.lr_schedule` (constant | linear | cosine), `min_lr_ratio`,
`warmup_steps` and `lr_schedule_steps`.

The clock. The schedule counts optimizer-step *slots*: a PPO step has exactly ppo_epochs x
num_minibatches of them (one per minibatch and epoch) and each one moves the clock by one, whether
DeepSpeed applies the step (the engine then steps the scheduler itself), skips it for non-finite
gradients (the engine does not step the scheduler: `advance_unapplied` does) or the learner takes none
(a minibatch with no sample on any rank, or no token left in the loss). So slot k of the run (0-based)
always trains at lr x factor(k), PPO step s (0-based) starts at slot s x ppo_epochs x num_minibatches,
and a run of run.steps PPO steps is

    lr_schedule_steps = run.steps x ppo_epochs x num_minibatches

slots long (the cluster fills it in: `cluster.config.schema.RunConfig`). Counting applied steps instead
would leave the schedule one slot behind for every skipped or empty minibatch, short of its floor at
the end of the run, by an amount no one can predict.

The factor, with W = warmup_steps, T = lr_schedule_steps, r = min_lr_ratio:

- k < W: (k + 1) / W, the linear warm-up the learner had before schedules (its first step already
  moves the weights; transformers' warm-ups start at 0);
- 'constant': 1;
- 'linear' / 'cosine': transformers' warmup-stable-decay lambda (`transformers.get_wsd_schedule`, no
  stable phase): p = (k - W) / (T - W), factor r + (1 - r) (1 - p) or r + (1 - r) (1 + cos(pi p)) / 2
  for W <= k < T, and r from T on. (transformers' `get_linear_schedule_with_warmup` has no floor, and
  `get_cosine_with_min_lr_schedule_with_warmup` rises again past T.)

The same factor scales every parameter group (the value head's `value_lr` too).

Resume: `LambdaLR.state_dict` holds the position (`last_epoch`) and each lambda's `__dict__`. The
lambdas here are `functools.partial`s of module-level functions: picklable (a Ray requirement), with
an empty `__dict__`, so a checkpoint holds only numbers (JSON in the consolidated format, weights-only
in DeepSpeed's) and a resumed run goes on from the saved slot along the schedule its own config
describes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial

import torch

from learner.config import LearnerConfig
from learner.registry import SCHEDULES

Factor = Callable[[int], float]


def warmup_then(step: int, *, warmup_steps: int, decay: Factor | None = None) -> float:
    """LR factor of optimizer-step slot `step` (0-based): (step + 1) / warmup_steps during the warm-up
    (step < warmup_steps), then `decay(step)`, or 1 without a decay ('constant')."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0 if decay is None else float(decay(step))


def _transformers_lambda(builder: Callable, **kwargs) -> Factor:
    """The lambda a transformers schedule builder puts in its LambdaLR (a `functools.partial` of a
    module-level function), taken from one built on a throwaway optimizer."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return builder(probe, **kwargs).lr_lambdas[0]


def constant(config: LearnerConfig, total: int | None) -> Factor | None:
    """'constant': no decay after the warm-up."""
    return None


def _decay(decay_type: str, config: LearnerConfig, total: int | None) -> Factor:
    from transformers import get_wsd_schedule

    if total is None:
        raise ValueError(
            f"learner.lr_schedule={config.lr_schedule!r} needs learner.lr_schedule_steps, the schedule's "
            "length in optimizer steps (a run fills it in: run.steps x ppo_epochs x num_minibatches)"
        )
    return _transformers_lambda(
        get_wsd_schedule,
        num_warmup_steps=config.warmup_steps,
        num_stable_steps=0,
        num_decay_steps=total - config.warmup_steps,
        decay_type=decay_type,
        min_lr_ratio=config.min_lr_ratio,
    )


# the builders of the decay after the warm-up that `learner.registry.SCHEDULES` names (None: constant)
linear = partial(_decay, "linear")
cosine = partial(_decay, "cosine")


def lr_factor(config: LearnerConfig) -> Factor:
    """The picklable factor of `config`'s schedule: slot -> multiple of each parameter group's lr."""
    decay = SCHEDULES.function(config.lr_schedule)(config, config.lr_schedule_steps)
    return partial(warmup_then, warmup_steps=config.warmup_steps, decay=decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: LearnerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LambdaLR of `config`'s schedule over `optimizer` (DeepSpeed steps it after an applied step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config))


def advance_unapplied(engine) -> None:
    """Move the schedule's clock over an optimizer-step slot that took no step (see the module doc)."""
    scheduler = engine.lr_scheduler
    if scheduler is None:
        return
    with warnings.catch_warnings():
        # torch's hint for a scheduler stepped before its optimizer ever was: here on purpose
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)` has been overridden")
        scheduler.step()
