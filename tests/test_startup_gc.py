"""An actor's start-up runs without the cyclic garbage collector and freezes what it built
(cluster/roles/startup.py): in a real Ray actor's process the collector is off through the module's
imports and `__init__`, on afterwards, with the start-up's objects frozen; a driver or test process
that imports or builds the same classes keeps its collector untouched."""

from __future__ import annotations

import gc

import pytest

from cluster.placement.colocated import ColocatedHost
from cluster.roles import startup
from cluster.roles.learner_actor import StreamingLearnerRank
from cluster.roles.registry import ROLES


def test_every_role_and_the_colocated_host_start_as_start_up_steps():
    for role in ROLES:
        assert getattr(role.actor_class().__init__, "start_up_step", False), role.name
    assert getattr(ColocatedHost.__init__, "start_up_step", False)
    assert getattr(StreamingLearnerRank.setup, "start_up_step", False)  # the model's load and DeepSpeed


def test_outside_an_actor_the_collector_is_left_as_it_was():
    @startup.starts_without_gc
    class Plain:
        def __init__(self) -> None:
            self.enabled_inside = gc.isenabled()

    frozen = gc.get_freeze_count()
    startup.pause_for_the_actors_start()
    assert gc.isenabled() and not startup._paused_at_import
    assert Plain().enabled_inside and gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()  # someone else's choice: it stays
    try:
        assert not Plain().enabled_inside and not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.slow
def test_a_real_actor_starts_without_the_collector_and_freezes_its_start(ray_local, demo_assets):
    from cluster.roles.actors import StreamingRolloutWorker
    from rollout_workers.config import RolloutConfig
    from rollout_workers.worker import RolloutWorker

    ray = ray_local

    def _collector(actor) -> tuple[bool, int, int, bool]:
        """(defined here, so Ray ships it by value) In the actor's process: (collector on, frozen objects, full collections so far, pause pending)."""
        import gc

        from cluster.roles import startup

        return (
            gc.isenabled(),
            gc.get_freeze_count(),
            gc.get_stats()[2]["collections"],
            startup._paused_at_import,
        )

    @startup.starts_without_gc
    class Records(RolloutWorker):  # defined here, so Ray ships it by value (the wrapper with it)
        def __init__(self, *args) -> None:
            self.enabled_inside = gc.isenabled()
            super().__init__(*args)

    args = (str(demo_assets.policy), RolloutConfig())
    actors = {
        cls: ray.remote(cls).options(num_cpus=0.25).remote(*args)
        for cls in (StreamingRolloutWorker, RolloutWorker, Records)
    }
    state = {cls: ray.get(a.__ray_call__.remote(_collector), timeout=300) for cls, a in actors.items()}
    try:
        on, frozen, full, pending = state[StreamingRolloutWorker]
        assert on and not pending
        assert frozen > 100_000  # torch, transformers and the model: what start-up built
        _, plain_frozen, plain_full, _ = state[RolloutWorker]  # the same role without the rule
        assert plain_frozen == 0 and full < plain_full
        assert ray.get(actors[Records].__ray_call__.remote(lambda w: w.enabled_inside), timeout=60) is False
        assert state[Records][0] and state[Records][1] > 100_000
    finally:
        for a in actors.values():
            ray.kill(a)
