"""The collective weight path (`rollout.weight_sync: collective`): learner rank 0 broadcasts each
bundle, bucket by bucket, over a process group of its own to every process holding a rollout engine's
weights; acknowledged and verified as the object-store path (`cluster.weights.push`)."""

from __future__ import annotations

import time
from typing import Any, get_args

import numpy as np
import ray

from cluster.config.schema import RunConfig
from cluster.records.ray_waits import DEAD_ACTOR_ERRORS, wait_until
from cluster.weights.push import (
    Fingerprint,
    SyncResult,
    WeightSyncError,
    bundle_facts,
    expected_fingerprint,
    stage_seconds,
    verify_ack,
    worker_method,
)
from cluster.weights.transport_choice import MemberPlace, TransportChoice, TransportRefused, choose_transport
from rollout_workers.config import WeightTransport

# rollout.weight_transport: how a bundle reaches the group's members (cluster.weights.transport_choice)
TRANSPORTS = frozenset(get_args(WeightTransport))


class _LostMembers(Exception):
    """Workers that died during a broadcast, or stopped answering and were killed (indices into the
    pushed workers)."""

    def __init__(self, indices: list[int]) -> None:
        super().__init__(indices)
        self.indices = indices


class CollectiveWeightSync:
    """The collective weight path: learner rank 0 broadcasts each bundle, bucket by bucket, over a
    group of its own (`learner.weight_broadcast`) to every process holding a rollout engine's weights
    (a hf worker; each tensor-parallel rank of a vLLM engine, inside vLLM), which loads each bucket in
    place as it arrives; every worker acknowledges exactly as after an object-store push.

    When every learner rank and worker is on one node with CPU weights, the bundle can travel through
    shared memory instead (`transport`: see `_use_shared_memory`; `learner.shared_bundle`): each learner rank
    writes its part of every tensor into a segment of rank 0's, and the group's broadcast carries only
    the header; the members read the segment. Acknowledgements, timeouts and lost members are the same.

    The group (gloo, or NCCL when learner and workers are on GPUs) is formed on the first push and
    again whenever the set of workers changes or a broadcast failed. Every collective on it has the
    `timeouts.weight_sync_s` timeout. A worker that dies during a broadcast makes it fail at once (its
    connection closes): the group is formed again without it, the version is broadcast again to the
    others, and it is reported in `lost` for the caller to replace. A worker that stops answering
    (stuck in other work, or hung inside the broadcast) is found when the timeout has passed and the
    members blocked behind it have failed their own collectives (at most one more timeout): it is
    killed and handled as a dead one. A learner rank that does not answer fails the push.
    """

    def __init__(
        self,
        bucket_mb: float = 64.0,
        backend: str = "gloo",
        cut_in: bool = False,
        transport: str = "auto",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport must be one of {sorted(TRANSPORTS)}, got {transport!r}")
        self.bucket_mb = bucket_mb
        self.backend = backend
        self.cut_in = cut_in  # pipeline.partial_rollout: workers join and receive inside a generation
        self.transport = transport
        self._members: tuple | None = None  # (timeout, actor ids) of the group formed
        self._shared: str | None = None  # its shared-memory segment, when the bundles travel through one

    @classmethod
    def from_config(cls, cfg: RunConfig) -> CollectiveWeightSync:
        """The run's group: its bucket size, backend (`weight_backend`), transport, and whether loads cut
        into a generation (`pipeline.partial_rollout`)."""
        r = cfg.rollout
        return cls(r.weight_bucket_mb, weight_backend(cfg), cfg.pipeline.partial_rollout, r.weight_transport)

    def _use_shared_memory(
        self, ranks: list[Any], workers: list[Any], names: list[str], deadline: float, dtype: str
    ) -> bool:
        """Whether the bundles go through shared memory (`_choose`)."""
        return self._choose(ranks, workers, names, deadline, dtype).transport == "shared_memory"

    def _choose(
        self, ranks: list[Any], workers: list[Any], names: list[str], deadline: float, dtype: str
    ) -> TransportChoice:
        """The transport and group backend for these members (`transport_choice.choose_transport`): each
        learner rank and worker is asked where it runs (its node, its CUDA device); the /dev/shm room
        only where shared memory is in question. A transport asked for that cannot apply is a
        `WeightSyncError` naming `rollout.weight_transport`. A worker that died before answering is lost
        (`_LostMembers`), as in the rest of the group's forming."""
        if self.transport == "broadcast":
            return TransportChoice("broadcast", self.backend)
        on_ranks = [r.__ray_call__.remote(_place) for r in ranks]
        asks = [worker_method(w, "__ray_call__", self.cut_in).remote(_place) for w in workers]
        _drop_silent(on_ranks, asks, workers, deadline, 0.0, "asking the learner's and workers' nodes")
        places = [
            MemberPlace(n, *p)
            for n, p in zip(names, _answers(asks, names, "could not report its node"), strict=True)
        ]
        try:
            places += [MemberPlace(f"learner rank {i}", *p) for i, p in enumerate(ray.get(on_ranks))]
        except ray.exceptions.RayError as err:
            raise WeightSyncError(f"a learner rank could not report its node: {err}") from err

        def room() -> tuple[int, int]:
            return tuple(ray.get(ranks[0].weight_segment_room.remote(dtype), timeout=_left(deadline)))

        try:
            return choose_transport(self.transport, places, self.backend, room)
        except TransportRefused as err:
            raise WeightSyncError(str(err)) from None

    def _form(
        self,
        ranks: list[Any],
        workers: list[Any],
        names: list[str],
        timeout: float,
        deadline: float,
        dtype: str,
    ) -> None:
        """(Re)form the group of learner rank 0 and `workers` (each taking its engine's `weight_receivers`
        ranks) unless it already is this one; every collective on it times out after `timeout`."""
        # the collectives' timeout is fixed when the group forms: another one forms a new group
        rank0 = ranks[0]
        members = (timeout, *(a._actor_id.hex() for a in (*ranks, *workers)))
        if members == self._members:
            return
        self._members = None
        choice = self._choose(ranks, workers, names, deadline, dtype)
        shared = {"shared_memory": True, "cuda_ipc": "cuda_ipc"}.get(choice.transport, False)
        host, port = ray.get(rank0.node_address.remote(), timeout=_left(deadline))
        asks = [worker_method(w, "weight_receivers", self.cut_in).remote() for w in workers]
        _drop_silent([], asks, workers, deadline, 0.0, "asking the workers' receivers")
        counts = _answers(asks, names, "could not report its weight receivers")
        world = 1 + sum(counts)
        firsts = np.cumsum([1, *counts[:-1]]).tolist() if workers else []
        joins = [rank0.join_weight_group.remote(host, port, world, timeout, choice.backend, shared)]
        joins += [
            worker_method(w, "join_weight_group", self.cut_in).remote(
                host, port, int(first), world, timeout, choice.backend
            )
            for w, first in zip(workers, firsts, strict=True)
        ]
        _drop_silent(joins[:1], joins[1:], workers, deadline, timeout, "the weight group's forming")
        _answers(joins[1:], names, "could not join the weight group")
        try:
            self._shared = ray.get(joins[0])
        except ray.exceptions.RayError as err:
            raise WeightSyncError(f"learner rank 0 could not form the weight group: {err}") from err
        self._members = members

    def push(
        self,
        ranks: list[Any],
        workers: list[Any],
        names: list[str],
        version: int,
        dtype: str,
        timeout: float,
        probe: bool = True,
    ) -> tuple[SyncResult, None]:
        """Broadcast v`version` and verify every acknowledgement (probe logprobs too when `probe`); no
        bundle is left in the object store.
        Workers lost during a broadcast are in the result's `lost` and the version is broadcast again
        to the others (each try has its own timeout; each loses at least one worker, so this ends); the
        rest hold v`version`. When every worker is lost, nobody holds v`version` and the result's
        `expected` is None: their replacements join a later broadcast or load an export of their own."""
        t0 = time.perf_counter()
        left, lost = list(range(len(workers))), []
        while left:
            deadline = time.monotonic() + timeout
            try:
                expected, stages = self._broadcast(
                    ranks,
                    [workers[i] for i in left],
                    [names[i] for i in left],
                    version,
                    dtype,
                    timeout,
                    deadline,
                    probe,
                )
                return SyncResult(version, expected, time.perf_counter() - t0, sorted(lost), stages), None
            except _LostMembers as gone:
                lost += [left[k] for k in gone.indices]
                left = [i for k, i in enumerate(left) if k not in gone.indices]
        return SyncResult(version, None, time.perf_counter() - t0, sorted(lost)), None

    def _broadcast(
        self,
        ranks: list[Any],
        workers: list[Any],
        names: list[str],
        version: int,
        dtype: str,
        timeout: float,
        deadline: float,
        probe: bool,
    ) -> tuple[Fingerprint, dict[str, float]]:
        self._form(ranks, workers, names, timeout, deadline, dtype)
        acks = [worker_method(w, "receive_weights", self.cut_in).remote(probe) for w in workers]
        refs = [
            r.broadcast_weights.remote(
                version, self.bucket_mb, bundle_facts(dtype), dtype, probe, self._shared
            )
            for r in ranks
        ]
        meta_ref = ranks[0].export_fingerprint.remote()
        try:
            _drop_silent([*refs, meta_ref], acks, workers, deadline, timeout, f"the broadcast of v{version}")
        except (_LostMembers, WeightSyncError):
            self._members = None
            raise
        dead, refused, failed = [], [], []
        for i, ack in enumerate(acks):
            try:
                ray.get(ack)
            except DEAD_ACTOR_ERRORS:
                dead.append(i)
            except ray.exceptions.RayTaskError as err:  # a refusal, or the broadcast failed under it
                group = type(err.cause).__name__ == "WeightGroupError"
                (failed if group else refused).append(f"{names[i]} did not load v{version}: {err.cause!r}")
        try:
            ray.get(refs)
        except ray.exceptions.RayTaskError as err:  # names the bucket that failed
            failed.insert(0, f"the broadcast of v{version} failed on learner rank 0: {err.cause!r}")
        problem = next(iter(refused + failed), None)  # a refusal names the cause best
        if dead or problem:
            self._members = None
        if dead:
            raise _LostMembers(dead)
        if problem:
            raise WeightSyncError(problem)
        meta = ray.get(meta_ref)
        expected = expected_fingerprint(meta, version, dtype)
        values = ray.get(acks)
        for name, ack in zip(names, values, strict=True):
            verify_ack(name, ack, version, expected)
        return expected, stage_seconds(meta, values)


def _place(actor: Any) -> tuple[str, str | None]:
    """Run inside an actor (`__ray_call__`): the Ray node it is on and the UUID of its current CUDA
    device (None where torch.cuda is not available)."""
    from kernel.cuda_ipc import device_uuid

    return ray.get_runtime_context().get_node_id(), device_uuid()


def _answers(calls: list[Any], names: list[str], failed: str) -> list[Any]:
    """The workers' finished `calls`' values; workers that died before answering are raised as lost
    (`_LostMembers`), any other error is a `WeightSyncError` naming the worker."""
    values, dead = [], []
    for i, call in enumerate(calls):
        try:
            values.append(ray.get(call))
        except DEAD_ACTOR_ERRORS:
            dead.append(i)
        except ray.exceptions.RayError as err:
            raise WeightSyncError(f"{names[i]} {failed}: {err}") from err
    if dead:
        raise _LostMembers(dead)
    return values


def _drop_silent(
    learner: list[Any], acks: list[Any], workers: list[Any], deadline: float, grace: float, what: str
) -> None:
    """Wait for the `learner`'s calls and the workers' `acks` until `deadline`. Members blocked behind
    one that stopped answering fail their own collectives within `grace` more; a worker still silent
    then is killed and raised as lost (`_LostMembers`); a silent learner rank is a `WeightSyncError`."""
    calls = [*learner, *acks]
    _, pending = wait_until(calls, len(calls), deadline)
    if pending and grace > 0:
        _, pending = wait_until(pending, len(pending), time.monotonic() + grace)
    silent = [i for i, a in enumerate(acks) if a in pending]
    for i in silent:  # stuck: killed, so that it cannot join or answer later (its connections close)
        ray.kill(workers[i], no_restart=True)
    waiting = [r for r in learner if r in pending]
    if silent and waiting:  # rank 0 may have been blocked on a killed one: it fails at once now
        _, waiting = wait_until(waiting, len(waiting), time.monotonic() + max(grace, 1.0))
    if waiting:
        raise WeightSyncError(
            f"{what} was not done within the timeout (timeouts.weight_sync_s): learner rank 0 did not answer"
        )
    if silent:
        raise _LostMembers(silent)


def weight_backend(cfg: RunConfig) -> str:
    """The weight group's backend: NCCL when learner ranks and rollout workers both have GPUs, else gloo
    (CPU buffers at both ends)."""
    return "nccl" if cfg.learner.num_gpus_per_rank and cfg.rollout.num_gpus_per_worker else "gloo"


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())
