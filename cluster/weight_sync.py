"""Learner -> rollout workers weight push through the object store, versioned and checksummed.

Rank 0's exported state dict is put in the object store once (as the return value of
`export_weights`) and every worker loads that same object; no copy passes through the driver.
Each worker acknowledges the version it now holds and the checksum of its weights, which must
equal the checksum of the bundle computed independently by a small task.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from rollout_workers.weights import state_checksum


class WeightSyncError(RuntimeError):
    """A worker did not load the pushed weights; the message names it."""


@ray.remote(num_cpus=0)
def _bundle_checksum(state: dict[str, torch.Tensor], dtype: str) -> str:
    return state_checksum(state, getattr(torch, dtype))


@dataclass
class SyncResult:
    version: int
    checksum: str
    seconds: float


def export_bundle(ranks: list[Any]) -> Any:
    """All ranks must take part (ZeRO-3 gathers shards); rank 0's return value is the bundle."""
    refs = [r.export_weights.remote() for r in ranks]
    return refs[0], refs[1:]


def push_weights(
    ranks: list[Any], workers: list[Any], names: list[str], version: int, dtype: str, timeout: float
) -> tuple[SyncResult, Any]:
    """Export, push to every worker, verify acknowledgements. Returns the result and the bundle ref."""
    t0 = time.perf_counter()
    bundle, others = export_bundle(ranks)
    expected_ref = _bundle_checksum.remote(bundle, dtype)
    acks = [w.load_weights.remote(bundle, version) for w in workers]
    everything = [*others, expected_ref, *acks]
    ready, pending = ray.wait(everything, num_returns=len(everything), timeout=timeout)
    if pending:
        late = [names[acks.index(r)] for r in pending if r in acks]
        raise WeightSyncError(
            f"weight sync v{version} not done within {timeout:.0f}s (timeouts.weight_sync_s); "
            f"waiting on: {', '.join(late) or 'learner export'}"
        )
    expected = ray.get(expected_ref)
    for name, (got_version, got_sum) in zip(names, ray.get(acks), strict=True):
        if got_version != version or got_sum != expected:
            raise WeightSyncError(
                f"{name} acknowledged v{got_version} checksum {got_sum[:12]}, expected v{version} {expected[:12]}"
            )
    return SyncResult(version, expected, time.perf_counter() - t0), bundle


def load_into(worker: Any, name: str, bundle: Any, version: int, expected: str, timeout: float) -> None:
    """Bring one (new) worker to the current weights before its first sample."""
    got_version, got_sum = ray.get(worker.load_weights.remote(bundle, version), timeout=timeout)
    if got_version != version or got_sum != expected:
        raise WeightSyncError(
            f"{name} loaded v{got_version} {got_sum[:12]}, expected v{version} {expected[:12]}"
        )
