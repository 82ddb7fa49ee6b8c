"""Learner rank actors kept from one learner test to the next: a process joins its torch.distributed
world once and then hosts one `LearnerRank` after another.

Why: starting a rank actor is ~8 CPU-seconds of imports (torch, transformers, DeepSpeed) and the
learner tests used to start about thirty of them, one world per group. Each group still gets fresh
`LearnerRank` objects through the product's own `__init__` and `setup`: DeepSpeed adopts the world
the process already holds, which `setup` verifies (`check_world`: this rank of this size), and the
previous test's engine is destroyed first. What is never reused: a group whose test raised (a rank
may still be inside a collective) is killed, and ranks of another class than `LearnerRank` (a test's
instrumented subclass) live for their test only. The pool is emptied before the first test of a
module that does not use it (tests/conftest.py), so the rest of the suite sees no extra actors.
"""

from __future__ import annotations

import gc
import sys
from contextlib import contextmanager

from learner.rank import LearnerRank

TIMEOUT_S = 120
CPUS_PER_RANK = 0.5

# world size -> idle groups of LearnerRank actors, rank order. A group is lent only inside its test's
# `with` block, so between tests every pooled group is here.
_free: dict[int, list[list]] = {}


def _reusable(cls: type) -> type:
    class Reusable(cls):
        """`cls` with the two steps between tests: drop the engine, start again as a new rank object."""

        def release(self) -> None:
            if self.engine is not None:
                self.engine.destroy()  # DeepSpeed's own teardown (ZeRO-3 hooks, optimizer buffers)
            self.engine = None
            gc.collect()

        def reuse(self, *args) -> None:
            self.release()
            cls.__init__(self, *args)

    Reusable.__name__ = Reusable.__qualname__ = f"Reusable{cls.__name__}"
    return Reusable


def _kill(ray, group: list, graceful: bool) -> None:
    try:
        if graceful:
            ray.get([r.shutdown.remote() for r in group], timeout=30)
    finally:
        for r in group:
            ray.kill(r)


@contextmanager
def learner_group(ray, n: int, model_path, config, temperature: float = 0.8, rank_cls: type = LearnerRank):
    """n `rank_cls` actors (ranks 0..n-1 of one world), set up together with `config`; on a clean exit
    a `LearnerRank` group goes back to the pool, otherwise its actors are killed."""
    args = (str(model_path), config, 0, 0, temperature)
    pooled = rank_cls is LearnerRank
    group = _free[n].pop() if pooled and _free.get(n) else None
    if group is None:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not importable on workers
        cls = ray.remote(_reusable(rank_cls) if pooled else rank_cls)
        group = [cls.options(num_cpus=CPUS_PER_RANK).remote(i, n, *args) for i in range(n)]
    else:
        ray.get([r.reuse.remote(i, n, *args) for i, r in enumerate(group)], timeout=TIMEOUT_S)
    clean = False
    try:
        addr = ray.get(group[0].node_address.remote(), timeout=TIMEOUT_S)
        ray.get([r.setup.remote(*addr) for r in group], timeout=TIMEOUT_S)
        yield group
        clean = True
    finally:
        _give_back(ray, group, pooled, clean)


def _give_back(ray, group: list, pooled: bool, clean: bool) -> None:
    if pooled and clean:
        try:
            ray.get([r.release.remote() for r in group], timeout=TIMEOUT_S)
        except BaseException:
            _kill(ray, group, graceful=False)
            raise
        _free.setdefault(len(group), []).append(group)
        return
    _kill(ray, group, graceful=not pooled)


def drain() -> None:
    """Shut every pooled rank down (leaving its world, removing its /dev/shm buffers) and kill it."""
    if not _free:
        return
    import ray

    groups = [g for idle in _free.values() for g in idle]
    _free.clear()
    for group in groups:
        _kill(ray, group, graceful=True)


def takes_ranks_from_the_pool(item) -> bool:
    """Whether a collected test is in a module that takes its learner ranks from the pool (every test
    there that starts Ray actors takes them from `learner_group`)."""
    return getattr(getattr(item, "module", None), "learner_group", None) is learner_group
