"""Learner -> rollout workers weight push through the object store, versioned and checksummed.

Rank 0's exported state dict is put in the object store once (as the return value of
`export_weights`) and every worker loads that same object; no copy passes through the driver.
Each worker acknowledges the version it now holds and the checksum of its weights, which must
equal the checksum of the bundle computed independently by a small task.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rollout_workers.weights import state_checksum

from .pools import DEAD_ACTOR_ERRORS, wait_until


class WeightSyncError(RuntimeError):
    """A worker did not load the pushed weights; the message names it."""


class BundleChecksum:
    """A long-lived, zero-CPU actor that checksums bundles independently of the workers.

    An actor, not a task: a task may need a fresh worker process (over a second) on any step.
    """

    def checksum(self, state: dict[str, torch.Tensor], dtype: str) -> str:
        return state_checksum(state, getattr(torch, dtype))


def start_checksummer() -> Any:
    return ray.remote(BundleChecksum).options(num_cpus=0).remote()


@dataclass
class SyncResult:
    version: int
    checksum: str
    seconds: float
    lost: list[int] = field(default_factory=list)  # workers that died or hung: the caller replaces them


def push_weights(
    ranks: list[Any],
    workers: list[Any],
    names: list[str],
    version: int,
    dtype: str,
    timeout: float,
    checksummer: Any,
) -> tuple[SyncResult, Any]:
    """Export, push to every worker, verify acknowledgements. Returns the result and the bundle ref.

    A worker that dies or does not answer in time is reported in `lost` (it holds no weights
    anyone relies on); a worker that answers with the wrong version or checksum is an error.
    """
    t0 = time.perf_counter()
    refs = [r.export_weights.remote() for r in ranks]  # all ranks take part (ZeRO-3 gathers shards)
    bundle = refs[0]
    expected_ref = checksummer.checksum.remote(bundle, dtype)
    acks = [w.load_weights.remote(bundle, version) for w in workers]
    _, pending = wait_until([*refs, expected_ref], len(refs) + 1, time.monotonic() + timeout)
    if pending:
        raise WeightSyncError(
            f"learner export of v{version} not done within {timeout:.0f}s (timeouts.weight_sync_s)"
        )
    ray.get(refs[1:])
    expected = ray.get(expected_ref)
    deadline = time.monotonic() + timeout
    lost = []
    for i, (name, ack) in enumerate(zip(names, acks, strict=True)):
        try:
            got_version, got_sum = ray.get(ack, timeout=max(0.0, deadline - time.monotonic()))
        except (*DEAD_ACTOR_ERRORS, ray.exceptions.GetTimeoutError):
            lost.append(i)
            continue
        if got_version != version or got_sum != expected:
            raise WeightSyncError(
                f"{name} acknowledged v{got_version} checksum {got_sum[:12]}, expected v{version} {expected[:12]}"
            )
    return SyncResult(version, expected, time.perf_counter() - t0, lost), bundle


def verify_ack(name: str, ack: tuple[int, str], version: int, expected: str) -> None:
    """A worker's acknowledgement of a load must name the version and the bundle's checksum."""
    got_version, got_sum = ack
    if got_version != version or got_sum != expected:
        raise WeightSyncError(
            f"{name} loaded v{got_version} {got_sum[:12]}, expected v{version} {expected[:12]}"
        )


def load_into(worker: Any, name: str, bundle: Any, version: int, expected: str, timeout: float) -> None:
    """Bring one (new) worker to the current weights before its first sample."""
    verify_ack(name, ray.get(worker.load_weights.remote(bundle, version), timeout=timeout), version, expected)
