"""Weight pushes are acknowledged by what the workers' engines compute on a fixed probe.

Unit checks of `verify_ack`, then a real learner rank (DeepSpeed ZeRO-2, a Ray actor) that trains one
step and pushes: an honest worker passes, a worker that acknowledges without loading is named.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.weights.collective import CollectiveWeightSync
from cluster.weights.push import (
    Fingerprint,
    WeightSyncError,
    bounded_checksum,
    expected_fingerprint,
    push_weights,
    verify_ack,
)
from kernel.sequences import probe_sequences
from rollout_workers.config import RolloutConfig
from rollout_workers.types import WeightAck
from rollout_workers.weights import state_checksum
from rollout_workers.worker import RolloutWorker

PROBE = [np.array([-3.0, -1.5, -7.25]), np.array([-0.5, -2.0])]


def _expected(checksum: str | None = "abc") -> Fingerprint:
    return Fingerprint(4, PROBE, checksum, atol=1e-4, rtol=1e-5)


def test_verify_ack_accepts_rounding_and_names_every_mismatch():
    close = [p + 5e-5 for p in PROBE]
    verify_ack("w0", WeightAck(4, close, "abc"), 4, _expected())
    verify_ack("w0", WeightAck(4, close, None), 4, _expected())  # vLLM: no checksum, the probe decides
    verify_ack("w0", WeightAck(4, close, "zzz"), 4, _expected(None))  # learner skipped it (too large)
    with pytest.raises(WeightSyncError, match="rollout-worker-3 acknowledged v3, expected v4"):
        verify_ack("rollout-worker-3", WeightAck(3, PROBE, "abc"), 4, _expected())
    with pytest.raises(WeightSyncError, match="rollout-worker-1 holds weights with checksum zzz"):
        verify_ack("rollout-worker-1", WeightAck(4, PROBE, "zzz"), 4, _expected())
    off = [PROBE[0], PROBE[1] + np.array([0.0, 3e-3])]
    with pytest.raises(
        WeightSyncError, match=r"rollout-worker-2 does not compute .* v4 .* up to 0\.003 nats"
    ):
        verify_ack("rollout-worker-2", WeightAck(4, off, None), 4, _expected())
    nan = [PROBE[0], np.array([np.nan, -2.0])]
    with pytest.raises(WeightSyncError, match="rollout-worker-2 does not compute"):
        verify_ack("rollout-worker-2", WeightAck(4, nan, None), 4, _expected())
    with pytest.raises(WeightSyncError, match="different probe"):
        verify_ack("rollout-worker-2", WeightAck(4, PROBE[:1], None), 4, _expected())


def test_expected_fingerprint_uses_the_coarser_dtype_and_checksums_small_bundles():
    meta = {"probe": PROBE, "checksum": None, "dtype": "float32"}
    assert expected_fingerprint(meta, 2, "float32").atol == 1e-4
    assert (
        expected_fingerprint(meta, 2, "bfloat16").atol
        == expected_fingerprint(dict(meta, dtype="bfloat16"), 2, "float32").atol
        > 0.1
    )
    state = {"a": torch.ones(4), "b": torch.zeros(2, dtype=torch.int64)}
    assert bounded_checksum(state, "bfloat16", 1 << 20) == state_checksum(state, torch.bfloat16)
    assert bounded_checksum(state, "float32", 8) is None


@pytest.fixture(scope="module")
def learner_rank(ray_local, tiny_policy_dir):
    from test_learner_ranks import _config

    from learner.rank import LearnerRank

    ray = ray_local
    rank = ray.remote(LearnerRank).options(num_cpus=0.5).remote(0, 1, str(tiny_policy_dir), _config(), 0, 0)
    addr, port = ray.get(rank.node_address.remote(), timeout=120)
    ray.get(rank.setup.remote(addr, port), timeout=120)
    yield rank
    ray.get(rank.shutdown.remote(), timeout=60)
    ray.kill(rank)


def _worker(ray, path, cls=RolloutWorker):
    return ray.remote(cls).options(num_cpus=0.25).remote(str(path), RolloutConfig())


@pytest.mark.slow
def test_push_acknowledged_by_probe_and_a_worker_that_did_not_load_is_named(
    ray_local, learner_rank, tiny_policy_dir
):
    from test_learner_ranks import _trajectories

    class AckWithoutLoading(RolloutWorker):  # defined here so Ray ships it by value
        """A broken worker: it acknowledges the version but keeps generating with its old weights,
        and has no checksum to give it away (as a vLLM engine): only the probe can tell."""

        def load_weights(self, state, version, probe=True):
            self._version = version
            return WeightAck(version, self.fingerprint().probe, None)

    ray, rank = ray_local, learner_rank
    honest, liar = _worker(ray, tiny_policy_dir), _worker(ray, tiny_policy_dir, AckWithoutLoading)
    try:
        result, bundle = push_weights([rank], [honest, liar], ["honest", "liar"], 1, "float32", 120)
        assert result.version == 1 and result.lost == []  # untrained: both hold the exported weights
        assert result.expected.checksum is not None
        assert [len(p) for p in result.expected.probe] == [len(s) - 1 for s in probe_sequences(28)]

        ray.get(rank.train_step.remote(_trajectories(4, seed=0)), timeout=120)
        with pytest.raises(WeightSyncError, match="liar does not compute what the learner's v2 weights"):
            push_weights([rank], [honest, liar], ["honest", "liar"], 2, "float32", 120)
        result, _ = push_weights([rank], [honest], ["honest"], 3, "float32", 120)
        ack = ray.get(honest.fingerprint.remote(), timeout=60)
        gap = max(float(np.abs(a - b).max()) for a, b in zip(ack.probe, result.expected.probe, strict=True))
        assert ack.version == 3 and gap < 1e-5  # hf and the learner's training forward, float32
    finally:
        for actor in (honest, liar):
            ray.kill(actor)


@pytest.mark.slow
def test_collective_broadcast_in_buckets_reaches_every_worker_and_regroups(
    ray_local, learner_rank, tiny_policy_dir
):
    from test_learner_ranks import _trajectories

    ray, rank = ray_local, learner_rank
    workers = [_worker(ray, tiny_policy_dir), _worker(ray, tiny_policy_dir)]
    sync = CollectiveWeightSync(bucket_mb=0.01, transport="broadcast")  # ~10 kB buckets: several
    try:
        ray.get(rank.train_step.remote(_trajectories(4, seed=1)), timeout=120)
        result, bundle = sync.push([rank], workers, ["w0", "w1"], 1, "float32", 120)
        assert bundle is None and result.version == 1
        exported = ray.get(
            rank.export_weights.remote(), timeout=120
        )  # the same weights, via the object store
        want = state_checksum(exported, torch.float32)
        assert result.expected.checksum == want
        assert ray.get([w.checksum.remote() for w in workers], timeout=60) == [want, want]

        # On one node the bundle can go through shared memory ('auto' picks it here): the learner writes
        # it into a segment of rank 0's, the broadcast carries the header, the workers read the segment
        # and hold the same weights; the segment is kept for the next push and removed with the group.
        shared = CollectiveWeightSync(transport="auto")
        for version in (2, 3):
            result, _ = shared.push([rank], workers, ["w0", "w1"], version, "float32", 120)
            assert result.version == version and result.expected.checksum == want
            assert ray.get([w.checksum.remote() for w in workers], timeout=60) == [want, want]
        segment = Path(shared._shared)
        assert segment.parent == Path("/dev/shm") and segment.stat().st_size >= sum(
            t.numel() * t.element_size() for t in {t.data_ptr(): t for t in exported.values()}.values()
        )

        workers.append(_worker(ray, tiny_policy_dir))  # a new member: the group forms again
        sync.push([rank], workers, ["w0", "w1", "w2"], 3, "float32", 120)
        assert ray.get([w.version.remote() for w in workers], timeout=60) == [3, 3, 3]
        assert not segment.exists()  # rank 0's group (and segment) of the shared push was replaced
        ray.get(workers[1].load_weights.remote(exported, 5), timeout=60)  # w1 moves ahead of the push
        with pytest.raises(WeightSyncError, match="w1 did not load v4: .*holds version 5; refusing older 4"):
            sync.push([rank], workers, ["w0", "w1", "w2"], 4, "float32", 120)
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
def test_collective_push_survives_a_receiver_killed_mid_broadcast_and_names_a_silent_one(
    ray_local, learner_rank, tiny_policy_dir
):
    """A receiver that dies after the first of many buckets: the broadcast fails at once (its
    connection closes), the group forms again without it, the others get the version, and it is
    reported lost for the caller to replace. A receiver that stops answering mid-broadcast: found
    once the timeout has passed and the members blocked behind it have failed their own collectives,
    killed, and handled the same way, instead of hanging (the failure mode of raw NCCL broadcasts).
    A receiver stuck in other work before a push (it never joins) is dropped the same way, also when
    it is the only one (then nobody holds the version, and the push says so instead of failing). A
    receiver that died before the push is lost while the group forms."""
    import time

    def _die_after_first_bucket(worker, stop: bool = False) -> None:  # here: Ray ships it by value
        """Run inside a rollout worker's process: from now on it dies (or, with `stop`, stops answering
        forever) right after receiving the first bucket of a broadcast: a peer lost mid-broadcast."""
        import os

        from rollout_workers import weight_receiver

        original = weight_receiver.BroadcastStream._bucket

        def bucket(stream):
            if stream._next == 1:
                if stop:
                    time.sleep(3600)
                os._exit(1)
            return original(stream)

        weight_receiver.BroadcastStream._bucket = bucket

    ray, rank = ray_local, learner_rank
    workers = [_worker(ray, tiny_policy_dir) for _ in range(3)]
    names = ["w0", "w1", "w2"]
    sync = CollectiveWeightSync(bucket_mb=0.01, transport="broadcast")  # ~10 kB buckets: dozens per push
    try:
        sync.push([rank], workers, names, 1, "float32", 120)
        ray.get(workers[1].__ray_call__.remote(_die_after_first_bucket), timeout=60)
        result, _ = sync.push([rank], workers, names, 2, "float32", 120)
        assert result.lost == [1] and result.version == 2
        assert ray.get([workers[0].version.remote(), workers[2].version.remote()], timeout=60) == [2, 2]

        ray.get(workers[2].__ray_call__.remote(lambda w: _die_after_first_bucket(w, stop=True)), timeout=60)
        t0 = time.monotonic()
        result, _ = sync.push([rank], [workers[0], workers[2]], ["w0", "w2"], 3, "float32", 8)
        # bounded by the timeout (8 s: the wait, the blocked members' own timeouts, the second
        # broadcast), not by the silent peer
        assert time.monotonic() - t0 < 120
        assert result.lost == [1] and ray.get(workers[0].version.remote(), timeout=60) == 3
        with pytest.raises(ray.exceptions.RayActorError):  # killed: it cannot answer later
            ray.get(workers[2].version.remote(), timeout=60)

        stuck = _worker(ray, tiny_policy_dir)  # busy in other work: it never joins the new group
        stuck.__ray_call__.remote(lambda w: time.sleep(3600))
        t0 = time.monotonic()
        result, _ = sync.push([rank], [workers[0], stuck], ["w0", "stuck"], 4, "float32", 8)
        assert time.monotonic() - t0 < 120
        assert result.lost == [1] and ray.get(workers[0].version.remote(), timeout=60) == 4

        # every member lost: nobody holds v5, the result says so (no fingerprint acknowledged) and the
        # caller replaces them; the next broadcast forms a group without them
        alone = _worker(ray, tiny_policy_dir)
        alone.__ray_call__.remote(lambda w: time.sleep(3600))
        result, _ = sync.push([rank], [alone], ["alone"], 5, "float32", 8)
        assert result.lost == [0] and result.expected is None and result.version == 5
        result, _ = sync.push([rank], [workers[0]], ["w0"], 5, "float32", 120)
        assert result.lost == [] and ray.get(workers[0].version.remote(), timeout=60) == 5

        # a worker that died before the push (killed between two broadcasts): lost while the group
        # forms, before any broadcast; the others get the version
        gone = _worker(ray, tiny_policy_dir)
        ray.kill(gone, no_restart=True)
        result, _ = sync.push([rank], [gone, workers[0]], ["gone", "w0"], 6, "float32", 120)
        assert result.lost == [0] and ray.get(workers[0].version.remote(), timeout=60) == 6
    finally:
        for w in workers:
            ray.kill(w)


def _kill_for_certain(ray, actor) -> None:
    """Kill `actor` and return once Ray says it is dead (a call on it fails): `ray.kill` only asks, and a
    call made at once may still be answered. Whatever runs next finds it dead, without racing the kill."""
    import time

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
    raise AssertionError(f"{actor} still answers 60 s after ray.kill")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["auto", "shared_memory"])
def test_a_member_dead_when_the_group_asks_the_nodes_is_lost_not_raised(
    ray_local, learner_rank, tiny_policy_dir, transport
):
    """On one node the group's forming first asks every member's node (the shared-memory check). A
    worker killed before that call (dead for certain: its own call fails first, nothing races) is a
    lost member there as everywhere else in the push: reported in `lost` for the caller to replace,
    and the push is retried without it; the others load the version through shared memory. Before,
    the check's plain `ray.get` let the `ActorDiedError` out of the push (and the run)."""
    ray, rank = ray_local, learner_rank
    gone, alive = _worker(ray, tiny_policy_dir), _worker(ray, tiny_policy_dir)
    sync = CollectiveWeightSync(transport=transport)
    try:
        ray.get([gone.ping.remote(), alive.ping.remote()], timeout=120)  # both started
        _kill_for_certain(ray, gone)
        result, _ = sync.push([rank], [gone, alive], ["gone", "alive"], 7, "float32", 120)
        assert result.lost == [0] and result.version == 7 and result.expected is not None
        assert ray.get(alive.version.remote(), timeout=60) == 7
        assert sync._shared is not None and Path(sync._shared).parent == Path("/dev/shm")
    finally:
        for w in (gone, alive):
            ray.kill(w)


@pytest.mark.slow
def test_demo_trains_with_collective_weight_sync_and_a_new_worker_catches_up(
    ray_local, demo_assets, tmp_path
):
    from demo_run import CONFIG, SMALL_STEPS, demo_overrides

    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run

    ray = ray_local
    sets = {
        "rollout.weight_sync": "collective",
        "rollout.num_workers": 2,
        "rollout.num_cpus_per_worker": 0.25,
        "rollout.probe_every": 2,  # v1: first pushes, v2: on the cadence, v3: digests only
        **SMALL_STEPS,  # the versions are checked, not the learning
    }
    trainer = Run(load_config(CONFIG, demo_overrides(demo_assets, 3, **sets)), tmp_path / "run")
    versions = lambda: ray.get([w.version.remote() for w in trainer.roles.workers.handles], timeout=60)  # noqa: E731
    try:
        for step in (1, 2):
            m = trainer.iteration()
            assert versions() == [step, step] and m["policy_version"] == step
            assert trainer.weights.bundle is None  # the broadcast leaves nothing in the object store
            assert trainer.weights.fingerprint.probe is not None
        ray.get(trainer.control.set_target.remote("rollout", 3), timeout=60)
        trainer.apply_scaling()  # the new worker loads an export made for it, acknowledged by the probe
        assert versions() == [2, 2, 2]
        assert trainer.weights.probed == set(trainer.roles.workers.names)
        m = trainer.iteration()  # the group forms again with the new member
        assert versions() == [3, 3, 3] and m["scale/rollout_workers"] == 3
        assert trainer.weights.fingerprint.probe is None  # every engine passed a probe before: digests
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_that_keeps_the_previous_version_is_refused_after_one_real_step(
    ray_local, tiny_policy_dir, dtype
):
    """One PPO step at the demo's learning rate (2e-4, Adam) moves the probe logprobs by less than the
    bf16 tolerance, so the probe alone passes an engine that kept v1; the digest (a sample of every
    tensor, at the rollout dtype) tells v1 from v2 in both dtypes. The stale engine is a real worker
    whose engine's load was made a no-op after v1 (injected, as the chaos test kills actors)."""
    from test_learner_ranks import _trajectories

    from learner.config import LearnerConfig
    from learner.rank import LearnerRank

    ray = ray_local
    config = LearnerConfig(lr=2e-4, dist_timeout_s=60)  # the sentiment demo's policy learning rate
    rank = ray.remote(LearnerRank).options(num_cpus=0.5).remote(0, 1, str(tiny_policy_dir), config, 0, 0)
    workers = [
        ray.remote(RolloutWorker)
        .options(num_cpus=0.25)
        .remote(str(tiny_policy_dir), RolloutConfig(dtype=dtype))
        for _ in range(2)
    ]
    names = ["honest", "stale"]
    try:
        ray.get(rank.setup.remote(*ray.get(rank.node_address.remote(), timeout=120)), timeout=120)
        push_weights([rank], workers, names, 1, dtype, 120)
        ray.get(
            workers[1].__ray_call__.remote(lambda w: setattr(w._engine, "_load_weights", lambda state: None))
        )
        ray.get(rank.train_step.remote(_trajectories(8, seed=0)), timeout=120)
        with pytest.raises(WeightSyncError, match="stale holds weights that are not v2"):
            push_weights([rank], workers, names, 2, dtype, 120)
        expected = expected_fingerprint(ray.get(rank.export_fingerprint.remote()), 2, dtype)
        verify_ack("honest", ray.get(workers[0].fingerprint.remote()), 2, expected)
        stale = ray.get(workers[1].fingerprint.remote())
        gap = max(float(np.abs(a - b).max()) for a, b in zip(stale.probe, expected.probe, strict=True))
        assert gap > 0.0
        if dtype == "bfloat16":  # what the digest is for: the probe alone cannot see one step in bf16
            probe_only = dataclasses.replace(expected, digest=None, checksum=None)
            verify_ack("stale", dataclasses.replace(stale, version=2, checksum=None), 2, probe_only)
    finally:
        for actor in (rank, *workers):
            ray.kill(actor)


@pytest.mark.slow
def test_off_the_probes_cadence_digests_still_refuse_a_stale_engine_and_on_it_the_probe_a_wrong_one(
    ray_local, tiny_policy_dir
):
    """rollout.probe_every=3 as the publisher applies it: v1 is every worker's first push (probed), v2
    checks digests only, v3 is on the cadence. A worker whose engine's load is a no-op is refused at
    v2 by its digest, with no probe scored on either side. A worker that holds the right weights but
    computes wrong logits (a hook on its output layer, as a faulty kernel would) passes the digests at
    v2 and is refused at v3 by the probe. Real learner rank (DeepSpeed), real hf workers."""
    from test_learner_ranks import _trajectories

    from cluster.weights.probe_cadence import ProbeCadence
    from learner.config import LearnerConfig
    from learner.rank import LearnerRank

    ray = ray_local
    rank = (
        ray.remote(LearnerRank)
        .options(num_cpus=0.5)
        .remote(0, 1, str(tiny_policy_dir), LearnerConfig(), 0, 0)
    )
    names = ["honest", "wrong", "stale"]
    workers = [
        ray.remote(RolloutWorker).options(num_cpus=0.25).remote(str(tiny_policy_dir), RolloutConfig())
        for _ in names
    ]
    honest, wrong, stale = workers
    assert [ProbeCadence(3).due(v) for v in (1, 2, 3)] == [False, False, True]

    def step_and_push(version: int, to: list, probe: bool):
        ray.get(rank.train_step.remote(_trajectories(8, seed=version)), timeout=120)
        return push_weights([rank], to, [names[workers.index(w)] for w in to], version, "float32", 120, probe)

    try:
        ray.get(rank.setup.remote(*ray.get(rank.node_address.remote(), timeout=120)), timeout=120)
        result, _ = push_weights([rank], workers, names, 1, "float32", 120, probe=True)  # first pushes
        assert result.expected.probe is not None
        ray.get(stale.__ray_call__.remote(lambda w: setattr(w._engine, "_load_weights", lambda state: None)))
        ray.get(
            wrong.__ray_call__.remote(
                lambda w: w._engine.model.get_output_embeddings().register_forward_hook(
                    lambda m, i, o: o * 1.5
                )
            )
        )
        with pytest.raises(WeightSyncError, match="stale holds weights that are not v2"):
            step_and_push(2, [stale], probe=False)
        result, _ = push_weights([rank], [honest, wrong], names[:2], 2, "float32", 120, probe=False)
        assert result.expected.probe is None and result.stages["learner_probe_s"] < 0.05
        assert ray.get(wrong.version.remote()) == 2  # the digests cannot see what it computes
        with pytest.raises(WeightSyncError, match="wrong does not compute what the learner's v3 weights"):
            step_and_push(3, [honest, wrong], probe=True)
    finally:
        for actor in (rank, *workers):
            ray.kill(actor)


def test_the_publisher_probes_on_the_cadence_and_every_workers_first_push():
    from types import SimpleNamespace

    from cluster.weights.publisher import WeightPublisher

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(probe_every=3, weight_sync="object_store"),
        pipeline=SimpleNamespace(partial_rollout=False),
    )
    publisher = WeightPublisher(cfg)
    assert publisher.probe_wanted(1, ["w0", "w1"])  # first pushes
    publisher.checked(["w0", "w1"], Fingerprint(1, PROBE, None, 1e-4, 1e-5))
    assert not publisher.probe_wanted(2, ["w0", "w1"])
    assert publisher.probe_wanted(3, ["w0", "w1"]) and publisher.probe_wanted(6, ["w0"])
    assert publisher.probe_wanted(4, ["w0", "w2"])  # w2 is new
    publisher.checked(["w2"], Fingerprint(4, None, None, 1e-4, 1e-5))  # loaded a digest-only version
    assert publisher.probe_wanted(5, ["w2"])  # still owes its first probe
    publisher.checked(["w2"], Fingerprint(5, PROBE, None, 1e-4, 1e-5))
    assert not publisher.probe_wanted(5, ["w0", "w1", "w2"])


def test_auto_cadence_keeps_the_probe_to_its_share_of_the_wall_time():
    """probe_every='auto': after a probed push whose probe took c seconds (learner + slowest engine),
    the next probe is due c / PROBE_SHARE seconds later; a worker's first push is probed regardless.
    The clock is the test's: 28 ms of probe (the demo on 2 cores) at 0.02 -> due again after 1.4 s."""
    from types import SimpleNamespace

    from cluster.weights.probe_cadence import PROBE_SHARE, ProbeCadence
    from cluster.weights.publisher import WeightPublisher

    assert PROBE_SHARE == 0.02
    now = [100.0]
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(probe_every="auto", weight_sync="object_store"),
        pipeline=SimpleNamespace(partial_rollout=False),
    )
    publisher = WeightPublisher(cfg)
    publisher.cadence = ProbeCadence("auto", clock=lambda: now[0])
    assert publisher.probe_wanted(1, ["w0"])  # nothing measured yet
    probed = Fingerprint(1, PROBE, None, 1e-4, 1e-5)
    publisher.checked(["w0"], probed)
    publisher.probe_spent(
        probed, {"learner_probe_s": 0.018, "worker_probe_s": 0.010, "learner_gather_s": 5.0}
    )
    assert not publisher.probe_wanted(2, ["w0"])
    now[0] += 1.39
    assert not publisher.probe_wanted(3, ["w0"]) and publisher.probe_wanted(3, ["w0", "w1"])  # w1: first push
    publisher.probe_spent(Fingerprint(3, None, None, 1e-4, 1e-5), {"learner_probe_s": 9.0})  # digests only
    now[0] += 0.02
    assert publisher.probe_wanted(4, ["w0"])  # 1.41 s after a 28 ms probe
    publisher.probe_spent(probed, {})  # a probe that cost nothing measurable: the next is due at once
    assert publisher.probe_wanted(5, ["w0"])


def test_a_digest_only_push_skips_the_probe_and_a_probed_push_needs_the_workers_answer():
    fp = dataclasses.replace(_expected(None), digest="d2")
    verify_ack(
        "w", WeightAck(4, None, None, received="d2", held="d2"), 4, dataclasses.replace(fp, probe=None)
    )
    with pytest.raises(WeightSyncError, match="w answered no probe logprobs for v4"):
        verify_ack("w", WeightAck(4, None, None, received="d2", held="d2"), 4, fp)
    with pytest.raises(WeightSyncError, match="w holds weights that are not v4"):  # digests: every push
        verify_ack(
            "w", WeightAck(4, None, None, received="d2", held="d1"), 4, dataclasses.replace(fp, probe=None)
        )


def test_verify_ack_checks_digests_before_anything_else():
    fp = dataclasses.replace(_expected(None), digest="d2")
    verify_ack("w", WeightAck(4, PROBE, None, received="d2", held="d2"), 4, fp)  # hf: exact
    verify_ack("w", WeightAck(4, PROBE, None, received="d2", changed=True, bundle_changed=True), 4, fp)
    verify_ack("w", WeightAck(4, PROBE, None, received="d2", changed=False, bundle_changed=False), 4, fp)
    verify_ack("w", WeightAck(4, PROBE, None, received="d2", changed=False), 4, fp)  # first load: unknown
    with pytest.raises(WeightSyncError, match="w received a bundle that is not v4"):
        verify_ack("w", WeightAck(4, PROBE, None, received="d1"), 4, fp)
    with pytest.raises(WeightSyncError, match="w holds weights that are not v4"):
        verify_ack("w", WeightAck(4, PROBE, None, received="d2", held="d1"), 4, fp)
    with pytest.raises(WeightSyncError, match="w kept its previous weights.*stale engine"):
        verify_ack("w", WeightAck(4, PROBE, None, received="d2", changed=False, bundle_changed=True), 4, fp)


def test_sampled_digest_reaches_the_last_element_of_large_tensors():
    """25M elements: a float linspace of indices rounds past the end there (it crashed on GPT-2's embedding)."""
    from rollout_workers.weights import sampled_digest

    big = torch.zeros(24_576_000)
    before = sampled_digest([("w", big)])
    big[-1] = 1.0  # the last element is always sampled
    assert sampled_digest([("w", big)]) != before
    big[1] = 1.0  # one between samples is not (the digest is a sample, by design)
    assert sampled_digest([("w", big)]) == sampled_digest(
        [("w", big.clone().index_fill_(0, torch.tensor([1]), 0.0))]
    )
