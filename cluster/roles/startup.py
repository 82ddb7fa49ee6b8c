"""An actor's start-up without Python's cyclic garbage collector, and what it built frozen afterwards.

Starting a role's actor imports torch and transformers (a learner rank's, DeepSpeed too) and loads a
model: about a million long-lived objects and no garbage. Each burst of allocations still wakes the
cyclic collector, and its full collections walk the whole, growing heap. Measured on the 2-core CPU
machine: importing a role's actor module and loading the demo policy costs 2.0 + 1.5 s of CPU with the
collector and 1.6 + 1.05 s without it (6 full collections against none). Set-up of the small demo,
alternating both sides in one script: separate placement (a learner rank and three role actors
starting at once) 9.1-10.6 s before, 7.1-8.5 s with this rule; colocated 5.0-5.5 s before, 3.8-4.1 s.

The rule, in an actor's own process only:
- the collector is off from the moment the process imports an actor class's module to start that
  actor (`pause_for_the_actors_start`, called before the module's heavy imports) until the class's
  `__init__` returns or raises (`starts_without_gc`, on the class); a later start-up call, such as a
  learner rank's `setup` (the model's load and DeepSpeed's engine), is a `start_up_step` of its own;
- then every object that start-up built goes to the permanent generation (`gc.freeze`), so that the
  collections of the step loop never walk the model's modules again, and the collector is back on.

The price: cyclic garbage made during start-up is frozen with the rest and never freed (about 13,000
objects for a rollout worker of the demo, once per start-up step, not growing with the run); a full
collection to find it first would cost 0.34 s of the 0.8 s saved.

A driver or a test that imports these modules or builds these classes in its own process keeps its
collector as it was, and a collector someone else turned off stays off. A class built while another's
start-up is running (the colocated host builds every role) is part of that start-up.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import ray

T = TypeVar("T", bound=type)

_paused_at_import = False  # this module turned the collector off for an actor's start


def in_an_actors_process() -> bool:
    """Whether this process is a Ray actor's (not a driver, not a task's worker). Asks nothing of a
    process that is not connected to Ray: `ray.get_runtime_context()` would connect it."""
    if not ray.is_initialized():
        return False
    context = ray.get_runtime_context()
    return context.worker.mode == ray.WORKER_MODE and context.get_actor_id() is not None


def pause_for_the_actors_start() -> None:
    """Turn the collector off for the imports that follow, when they start this process's actor."""
    global _paused_at_import
    if gc.isenabled() and in_an_actors_process():
        gc.disable()
        _paused_at_import = True


def begin_start_up_step() -> bool:
    """Turn the collector off for a start-up step; True when `end_start_up_step` must turn it back on."""
    global _paused_at_import
    resume = _paused_at_import or (gc.isenabled() and in_an_actors_process())
    _paused_at_import = False
    if resume:
        gc.disable()
    return resume


def end_start_up_step() -> None:
    gc.freeze()
    gc.enable()


def start_up_step(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` as a step of its actor's start-up: run with the collector off (in an actor's process),
    then what it built frozen and the collector back on, unless an enclosing start-up step will."""

    @functools.wraps(method)
    def step(self, *args, **kwargs) -> Any:
        # This module itself, not names bound where the wrapper was defined: Ray ships an actor class
        # by value, and this function with it, under a copy of its globals.
        from cluster.roles import startup

        resume = startup.begin_start_up_step()
        try:
            return method(self, *args, **kwargs)
        finally:
            if resume:
                startup.end_start_up_step()

    step.start_up_step = True  # type: ignore[attr-defined]
    return step


def starts_without_gc(cls: T) -> T:
    """`cls.__init__` as its actor's start-up step (`start_up_step`)."""
    cls.__init__ = start_up_step(cls.__init__)
    return cls
