"""Learner -> rollout workers weight push through the object store, versioned, and acknowledged by
what the workers' engines compute.

Rank 0's exported state dict is put in the object store once (as the return value of
`export_weights`) and every worker loads that same object; no copy passes through the driver.
While exporting, rank 0 also records what the workers must acknowledge (`export_fingerprint`): its
own teacher-forced logprobs on a few fixed probe sequences (`kernel.sequences.probe_sequences`),
through the training forward, and the bundle's checksum at the rollout dtype when the bundle is
small enough for that to be cheap. Each worker answers with the version it now holds, its engine's
logprobs on the same probe, and (hf) the checksum of the weights it reads back. What was sent
proves nothing; a stale, partial or ignored load shows in what the engine computes. Probe logprobs
of two engines on equal weights agree to rounding: the tolerance is per dtype (`PROBE_TOLERANCE`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray

from cluster.config.schema import RunConfig
from cluster.records.ray_waits import DEAD_ACTOR_ERRORS, wait_until
from cluster.roles.registry import WEIGHTS_GROUP

# (atol, rtol) in nats for |worker - learner| probe logprobs, by the coarser of the two dtypes.
# Measured against a float32 learner on the demo policy (probe |logprob| up to 18): float32 engines
# (hf, vLLM) agree to ~1e-6; bfloat16 up to 0.049 (mean 0.015), float16 up to 0.009, for both engines.
PROBE_TOLERANCE = {"float32": (1e-4, 1e-5), "float16": (0.05, 0.005), "bfloat16": (0.15, 0.02)}
_PRECISION = ["float32", "float16", "bfloat16"]  # increasingly coarse
CHECKSUM_MAX_BYTES = 1 << 30  # above this the byte checksum is skipped (a hash pass of the bundle)


def worker_method(handle: Any, method: str, cut_in: bool = False) -> Any:
    """`handle.<method>`; with `cut_in` on the worker's own concurrency group for weight calls, so it runs
    while a generate call holds the default one (`pipeline.partial_rollout`: the worker lets it in at
    the engine's next interruption point). Without it, calls run in submission order."""
    bound = getattr(handle, method)
    return bound.options(concurrency_group=WEIGHTS_GROUP) if cut_in else bound


class WeightSyncError(RuntimeError):
    """A worker did not load the pushed weights; the message names it."""


@dataclass
class Fingerprint:
    """What every worker must acknowledge for one pushed version."""

    version: int
    probe: list[np.ndarray] | None  # learner rank 0's logprobs on the probe sequences; None: not scored
    checksum: str | None  # of the bundle at the rollout dtype; None when skipped (too large)
    atol: float
    rtol: float
    digest: str | None = None  # `sampled_digest` of the bundle at the rollout dtype


def bounded_checksum(state: dict[str, Any], dtype: str, max_bytes: int) -> str | None:
    """`state_checksum(state, dtype)`, or None for a bundle over `max_bytes` (runs on learner rank 0,
    which imports torch; the driver never does)."""
    from rollout_workers.weights import state_checksum, torch_dtype

    unique = {t.data_ptr(): t for t in state.values()}
    if sum(t.numel() * t.element_size() for t in unique.values()) > max_bytes:
        return None
    return state_checksum(state, torch_dtype(dtype))


@dataclass
class SyncResult:
    version: int
    expected: Fingerprint | None  # None: every worker was lost, nobody acknowledged this version
    seconds: float
    lost: list[int] = field(default_factory=list)  # workers that died or hung: the caller replaces them
    stages: dict[str, float] = field(default_factory=dict)  # `stage_seconds`


def stage_seconds(meta: dict, acks: list[Any]) -> dict[str, float]:
    """Where a push's time went: learner rank 0's stages ('learner_probe_s', 'learner_gather_s',
    'learner_describe_s', and 'learner_send_s' for a broadcast) and each worker stage's slowest worker
    ('worker_load_s', 'worker_checksum_s', 'worker_digest_s', 'worker_probe_s')."""
    out = {f"learner_{k}": float(v) for k, v in (meta.get("timings") or {}).items()}
    for ack in acks:
        for k, v in ack.timings.items():
            out[f"worker_{k}"] = max(out.get(f"worker_{k}", 0.0), float(v))
    return out


def push_weights(
    ranks: list[Any],
    workers: list[Any],
    names: list[str],
    version: int,
    dtype: str,
    timeout: float,
    probe: bool = True,
) -> tuple[SyncResult, Any]:
    """Export, push to every worker, verify acknowledgements. Returns the result and the bundle ref.

    `dtype` is the rollout dtype; `probe`: the learner and every engine score the probe sequences. A
    worker that dies or does not answer in time is reported in `lost` (it holds no weights anyone
    relies on); a worker that answers with the wrong version, digest, checksum or probe logprobs is an
    error naming it.
    """
    t0 = time.perf_counter()
    refs, meta_ref = _start_export(ranks, dtype, probe)
    bundle = refs[0]
    acks = [w.load_weights.remote(bundle, version, probe) for w in workers]  # they load once it is there
    meta = _finish_export(refs, meta_ref, f"learner export of v{version}", timeout)
    expected = expected_fingerprint(meta, version, dtype)
    lost, values = _collect_acks(names, acks, version, expected, timeout)
    stages = stage_seconds(meta, values)
    return SyncResult(version, expected, time.perf_counter() - t0, lost, stages), bundle


class ObjectStorePush:
    """`rollout.weight_sync: object_store` as a pusher (`cluster.weights.syncs`): `push_weights`."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> ObjectStorePush:
        return cls()

    def push(self, *args: Any, **kwargs: Any) -> tuple[SyncResult, Any]:
        return push_weights(*args, **kwargs)


def push_colocated(
    hosts: list[Any],
    workers: list[Any],
    names: list[str],
    version: int,
    dtype: str,
    timeout: float,
    probe: bool = True,
) -> tuple[SyncResult, Any]:
    """The colocated placement's push (`cluster.placement.colocated`): every host exports from its learner rank
    and rank 0's host loads the bundle into its own rollout worker in memory (waking its engine
    first); workers on other hosts load an object-store copy, which is also the returned bundle ref
    (None with one host: nothing leaves the process). Acknowledged and verified as `push_weights`."""
    t0 = time.perf_counter()
    share = len(workers) > 1
    refs = [
        h.push_local.remote(version, bundle_facts(dtype), share and i == 0, dtype, probe)
        for i, h in enumerate(hosts)
    ]
    _wait_for_export(refs, f"learner export of v{version}", timeout)
    try:
        ack, meta, bundle = ray.get(refs)[0]
    except ray.exceptions.RayTaskError as err:
        raise WeightSyncError(
            f"{names[0] if names else 'the host of learner rank 0'} did not load v{version}: {err.cause!r}"
        ) from err
    expected = expected_fingerprint(meta, version, dtype)
    if workers:
        verify_ack(names[0], ack, version, expected)
    acks = [w.load_weights.remote(bundle, version, probe) for w in workers[1:]]
    lost, values = _collect_acks(names[1:], acks, version, expected, timeout)
    if lost:  # a worker on another host is gone: its host (a learner rank) is gone too
        raise WeightSyncError(
            f"{[names[i + 1] for i in lost]} lost while loading v{version} (its learner rank's process)"
        )
    stages = stage_seconds(meta, [ack, *values] if workers else values)
    return SyncResult(version, expected, time.perf_counter() - t0, stages=stages), bundle


def export_bundle(ranks: list[Any], version: int, dtype: str, timeout: float) -> tuple[Any, Fingerprint]:
    """Learner rank 0's current weights in the rollout `dtype` put in the object store as v`version`
    (all ranks take part, the probe scored); the ref and what a worker that loads it must acknowledge."""
    refs, meta_ref = _start_export(ranks, dtype, True)
    meta = _finish_export(refs, meta_ref, "learner export", timeout)
    return refs[0], expected_fingerprint(meta, version, dtype)


def _start_export(ranks: list[Any], dtype: str, probe: bool) -> tuple[list[Any], Any]:
    """Start the export of the learner's weights in the rollout `dtype` (with the probe's logprobs when
    `probe`): every rank takes part (ZeRO-3);
    rank 0's reference is the bundle. Returns the ranks' references and that of rank 0's export
    record (its call runs after export_weights on the same actor)."""
    refs = [r.export_weights.remote(bundle_facts(dtype), dtype, probe) for r in ranks]
    return refs, ranks[0].export_fingerprint.remote()


def _finish_export(refs: list[Any], meta_ref: Any, what: str, timeout: float) -> dict[str, Any]:
    """Wait for an export `_start_export` began (within `timeout`, `what` naming it in the error) and
    return rank 0's export record. The bundle (refs[0]) is never pulled into the driver."""
    _wait_for_export([*refs, meta_ref], what, timeout)
    ray.get(refs[1:])
    return ray.get(meta_ref)


def describe_bundle(state: dict[str, Any], dtype: str, max_bytes: int) -> dict[str, str | None]:
    """What learner rank 0 records about the bundle it exports, at the rollout dtype: its checksum
    (`bounded_checksum`) and its `sampled_digest`, which every worker's ack must match."""
    from rollout_workers.weights import sampled_digest, torch_dtype

    return {
        "checksum": bounded_checksum(state, dtype, max_bytes),
        "digest": sampled_digest(state.items(), torch_dtype(dtype)),
    }


def bundle_facts(dtype: str) -> Any:
    """The function learner rank 0 runs on the bundle while exporting (`describe_bundle` at `dtype`)."""
    return functools.partial(describe_bundle, dtype=dtype, max_bytes=CHECKSUM_MAX_BYTES)


def _wait_for_export(refs: list[Any], what: str, timeout: float) -> None:
    """Wait for every ref of an export (all learner ranks take part), or fail naming the timeout."""
    _, pending = wait_until(refs, len(refs), time.monotonic() + timeout)
    if pending:
        raise WeightSyncError(f"{what} not done within {timeout:.0f}s (timeouts.weight_sync_s)")


def _collect_acks(
    names: list[str], acks: list[Any], version: int, expected: Fingerprint, timeout: float
) -> tuple[list[int], list[Any]]:
    """Verify every acknowledgement; returns the indices of workers that died or did not answer, and
    the acknowledgements of the others."""
    deadline = time.monotonic() + timeout
    lost, values = [], []
    for i, (name, ack) in enumerate(zip(names, acks, strict=True)):
        try:
            value = ray.get(ack, timeout=max(0.0, deadline - time.monotonic()))
        except (*DEAD_ACTOR_ERRORS, ray.exceptions.GetTimeoutError):
            lost.append(i)
            continue
        except ray.exceptions.RayTaskError as err:  # the worker refused or failed the load
            raise WeightSyncError(f"{name} did not load v{version}: {err.cause!r}") from err
        verify_ack(name, value, version, expected)
        values.append(value)
    return lost, values


def expected_fingerprint(meta: dict, version: int, rollout_dtype: str) -> Fingerprint:
    """The acknowledgement to expect from learner rank 0's `export_fingerprint()`."""
    coarser = max(rollout_dtype, meta["dtype"], key=_PRECISION.index)
    atol, rtol = PROBE_TOLERANCE[coarser]
    probe = None if meta["probe"] is None else [np.asarray(p) for p in meta["probe"]]
    return Fingerprint(version, probe, meta.get("checksum"), atol, rtol, meta.get("digest"))


def verify_ack(name: str, ack: Any, version: int, expected: Fingerprint) -> None:
    """A worker's acknowledgement (`rollout_workers.types.WeightAck`) must name the version; the bundle
    it received and (hf) the weights it holds must have the learner's digest, and (vLLM) its engine's
    own digest must have moved when the bundle did; then the full checksum where both ends have one,
    and, when the push scored the probe, the engine must compute the learner's probe logprobs within
    tolerance."""
    if ack.version != version:
        raise WeightSyncError(f"{name} acknowledged v{ack.version}, expected v{version}")
    if expected.digest is not None and ack.received is not None and ack.received != expected.digest:
        raise WeightSyncError(f"{name} received a bundle that is not v{version} (its digest differs)")
    if expected.digest is not None and ack.held is not None and ack.held != expected.digest:
        raise WeightSyncError(
            f"{name} holds weights that are not v{version} after loading it (digest differs)"
        )
    if ack.bundle_changed and ack.changed is False:
        raise WeightSyncError(
            f"{name} kept its previous weights: the v{version} bundle differs from the one it loaded before, "
            "but the weights its engine holds did not change (a stale engine)"
        )
    if ack.checksum is not None and expected.checksum is not None and ack.checksum != expected.checksum:
        raise WeightSyncError(
            f"{name} holds weights with checksum {ack.checksum[:12]}, expected v{version} {expected.checksum[:12]}"
        )
    if expected.probe is None:
        return  # this version's push checks digests only (rollout.probe_every)
    if ack.probe is None:
        raise WeightSyncError(f"{name} answered no probe logprobs for v{version}, whose push asked for them")
    if [len(p) for p in ack.probe] != [len(p) for p in expected.probe]:
        raise WeightSyncError(f"{name} answered a different probe than the learner's (vocabularies differ?)")
    gap, bad = 0.0, False
    for got, want in zip(ack.probe, expected.probe, strict=True):
        diff = np.abs(np.asarray(got, dtype=np.float64) - want)
        gap = max(gap, float(np.max(diff, initial=0.0)))
        bad |= bool((~(diff <= expected.atol + expected.rtol * np.abs(want))).any())  # NaN is bad too
    if bad:
        raise WeightSyncError(
            f"{name} does not compute what the learner's v{version} weights compute: probe logprobs differ "
            f"by up to {gap:.3g} nats (tolerance {expected.atol:g} + {expected.rtol:g}*|logprob|)"
        )


def load_into(
    worker: Any, name: str, bundle: Any, version: int, expected: Fingerprint, timeout: float
) -> None:
    """Bring one (new) worker to the current weights before its first sample (probed when the bundle's
    export was)."""
    ack = worker.load_weights.remote(bundle, version, expected.probe is not None)
    verify_ack(name, ray.get(ack, timeout=timeout), version, expected)
