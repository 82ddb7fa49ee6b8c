"""Ray's failures as the run reads them, and a Ctrl-C-friendly wait: the one place every floor above asks
whether an actor died, an object was lost, or a call is ready by its deadline."""

from __future__ import annotations

from typing import Any

import ray

DEAD_ACTOR_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# An object whose every copy is gone (its node died; Ray cannot rebuild an actor's output): owner
# died, reconstruction failed, fetch timed out are all subclasses.
LOST_OBJECT_ERRORS = (ray.exceptions.ObjectLostError,)


def is_lost_object(err: BaseException) -> bool:
    """`err` (or the error a task raised, wrapped by Ray) is a lost object."""
    return isinstance(err, LOST_OBJECT_ERRORS) or isinstance(getattr(err, "cause", None), LOST_OBJECT_ERRORS)


def wait_until(refs: list[Any], num_returns: int, deadline: float) -> tuple[list[Any], list[Any]]:
    """`ray.wait` in slices of at most a second, so Ctrl-C reaches the driver during long waits."""
    import time

    pending = list(refs)
    ready: list[Any] = []
    while True:
        left = deadline - time.monotonic()
        got, pending = ray.wait(  # readiness only: never pulls the objects to the driver's node
            pending,
            num_returns=min(num_returns - len(ready), len(pending)),
            timeout=max(0.0, min(1.0, left)),
            fetch_local=False,
        )
        ready += got
        if len(ready) >= num_returns or not pending or left <= 0:
            return ready, pending
