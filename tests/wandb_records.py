"""Read an offline W&B run back from the files it wrote: the `run-<id>.wandb` transaction log.

The log is W&B's record stream (protobuf `Record`s of `wandb.proto.wandb_internal_pb2`) in the LevelDB
log format: a 7-byte file header (":W&B", magic, version), then 32 KiB blocks of chunks, each with a
7-byte header (CRC-32, length, type: full, first, middle, last). wandb ships no reader of its own any more
(the Go core writes it), so this is the format read directly; `wandb sync` reads the same file.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    """The payloads of every record in `path`, CRC-checked."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:  # zero padding at the block's end
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad CRC at byte {pos}"
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


@dataclass
class OfflineRun:
    run_id: str = ""
    config: dict = field(default_factory=dict)
    history: dict[int, dict] = field(default_factory=dict)  # step -> metrics
    summary: dict = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)


def read_offline_run(folder: Path) -> OfflineRun:
    """An `offline-run-*` folder's run: id, config, history rows by step, summary, saved files."""
    from wandb.proto import wandb_internal_pb2 as pb

    (log,) = Path(folder).glob("run-*.wandb")
    run = OfflineRun()
    for payload in records(log):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.tags = rec.run.run_id, list(rec.run.tags)
            run.config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            run.config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            run.history[int(row.pop("_step"))] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            run.summary.update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update}
            )
        elif kind == "files":
            run.files += [f.path for f in rec.files.files]
    return run
