"""What a rollout worker's engine holds, and the acknowledgement of each weight load.

The rule: an acknowledgement states what the engine computes after the load, never what the sender
meant to send. It carries the version now held, the digests of the bundle received and of the weights
held (`changed`: whether the held weights differ from before the load; `bundle_changed`: whether the
bundle differs from the previous one), the checksum at the engine dtype where the engine can read its
weights back, the engine's logprobs on a fixed probe (compared with the learner's on the same
weights) and the seconds each part took. With `rollout.lora_sync='adapter'` every one of these is of
the engine's LoRA adapter, not its full weights. A load that fails part-way forgets the checksum and
the last bundle's digest: nothing claims to describe weights that may be half loaded.

No lock here: the worker holds its `WeightGate` around every call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kernel.sequences import probe_sequences
from rollout_workers.engine import RolloutEngine
from rollout_workers.types import WeightAck


class HeldWeights:
    """The version, checksum and last bundle digest of the weights `engine` holds (`adapter`: loads
    carry a LoRA adapter alone, `rollout.lora_sync='adapter'`)."""

    def __init__(self, engine: RolloutEngine, adapter: bool, version: int) -> None:
        self.engine = engine
        self.adapter = adapter
        self.version = version
        self._checksum: str | None = None  # of the weights held now; computed lazily
        self.last_received: str | None = None  # digest of the last bundle loaded
        self.probe = probe_sequences(engine.vocab_size)  # fixed token sequences for fingerprints

    def swap(self, load: Callable[[], tuple[int, str]], t0: float, probe: bool) -> WeightAck:
        """Run `load` (it swaps the engine's weights and returns the version and the digest of the
        bundle it loaded) and acknowledge it with what the engine computes afterwards; the probe
        logprobs only when `probe`. `t0`: when the load began (the object-store path digests the
        bundle before calling this)."""
        engine = self.engine
        self._checksum = None  # whatever happens below, the old checksum no longer describes the weights
        marks = [time.perf_counter()]
        # what the engine holds: its adapter (rollout.lora_sync='adapter', named as the bundles), else its weights
        digest = engine.adapter_digest if self.adapter else engine.weights_digest
        names_match = engine.adapter_names_match if self.adapter else engine.digest_names_match
        before = None if names_match else digest()
        previous, self.last_received = self.last_received, None  # until this load succeeds
        marks.append(time.perf_counter())
        version, received = load()
        self.version = int(version)
        marks.append(time.perf_counter())
        self._checksum = self._read_checksum()
        marks.append(time.perf_counter())
        after = digest()
        marks.append(time.perf_counter())
        scored = engine.probe_logprobs(self.probe) if probe else None
        marks.append(time.perf_counter())
        took = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        ack = WeightAck(
            self.version,
            scored,
            self._checksum,
            received=received,
            held=after if names_match else None,
            changed=None if before is None else after != before,
            bundle_changed=None if previous is None else received != previous,
            timings={
                "load_s": took[1] + (marks[0] - t0),  # (the object-store path digests the bundle first)
                "checksum_s": took[2],
                "digest_s": took[0] + took[3],
                "probe_s": took[4],
            },
        )
        self.last_received = received
        return ack

    def fingerprint(self) -> WeightAck:
        """The acknowledgement of the weights held now, without loading anything."""
        return WeightAck(self.version, self.engine.probe_logprobs(self.probe), self.checksum())

    def checksum(self) -> str | None:
        """Checksum of the weights held now (at the engine dtype; see `rollout_workers.weights`), or
        None where the engine cannot read its weights back; read once per load."""
        if self._checksum is None:
            self._checksum = self._read_checksum()
        return self._checksum

    def _read_checksum(self) -> str | None:
        engine = self.engine
        return engine.adapter_checksum() if self.adapter else engine.weights_checksum()
