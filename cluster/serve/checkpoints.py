"""Named checkpoints of the Tinker API, kept per API key under the config's `checkpoint_dir`.

A checkpoint's name is the SDK's `tinker://<run>/<kind>/<name>` (`types.ParsedCheckpointTinkerPath`):
`<run>` is the training client's model_id, `<kind>` is `weights` (`save_state`: the adapter's trainable
tensors and, once a step was taken, the AdamW state) or `sampler_weights` (`save_weights_for_sampler`:
the adapter bundle as a rollout engine applies it). On disk it is one file,

    <checkpoint_dir>/<owner>/<run>/<kind>/<name>.pt      owner = sha256(API key)[:16] (no key on disk)

written to a temporary name in the same folder and renamed into place (`os.replace`), so a reader sees
the whole checkpoint or none. A path is always looked up in the caller's own folder: another key's
checkpoint is "does not exist", the same answer as a name never saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cluster.serve.futures import UserError

KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,199}")


@dataclasses.dataclass(frozen=True)
class CheckpointPath:
    run: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"tinker://{self.run}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, uri: str) -> CheckpointPath:
        """`tinker://<run>/<kind>/<name>`; anything else is refused naming the path and the form."""
        parts = uri[len("tinker://") :].split("/") if uri.startswith("tinker://") else []
        if (
            len(parts) != 3
            or parts[1] not in KINDS
            or not _RUN.fullmatch(parts[0])
            or not _NAME.fullmatch(parts[2])
        ):
            raise UserError(f"checkpoint path {uri!r} is not tinker://<run>/{{{'|'.join(KINDS)}}}/<name>")
        return cls(*parts)


def checkpoint_name(name: str | None, what: str) -> str:
    """The name a save request gives (`path` in its body), checked: one path segment, no dots first."""
    if name is None or not _NAME.fullmatch(name):
        raise UserError(f"{what}: the checkpoint name {name!r} must match {_NAME.pattern}")
    return name


class CheckpointStore:
    """Checkpoint files under `root`, one folder per API key; `root` None: named checkpoints are off."""

    def __init__(self, root: str | None) -> None:
        self.root = None if root is None else Path(root)

    def require(self) -> None:
        if self.root is None:
            raise UserError("named checkpoints are off: the service's config sets no checkpoint_dir")

    def _file(self, owner: str, path: CheckpointPath) -> Path:
        self.require()
        who = hashlib.sha256(owner.encode()).hexdigest()[:16]
        return self.root / who / path.run / path.kind / f"{path.name}.pt"

    def write(self, owner: str, path: CheckpointPath, payload: dict[str, Any], overwrite: bool) -> str:
        """Save atomically (a temporary file in the same folder, then a rename); the path's URI."""
        final = self._file(owner, path)
        if final.exists() and not overwrite:
            raise UserError(f"checkpoint {path.uri!r} exists (save with overwrite=True to replace it)")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return path.uri

    def listing(self, owner: str, run: str) -> list[dict[str, Any]]:
        """This owner's checkpoints of one training run (the SDK's `Checkpoint`: id, type, time, path,
        size), oldest first; a run of another key, or none, lists nothing."""
        if not _RUN.fullmatch(run):
            raise UserError(f"training run id {run!r} is not a model_id")
        self.require()
        out = []
        for kind, ckpt_type in zip(KINDS, ("training", "sampler"), strict=True):
            for file in sorted(self._file(owner, CheckpointPath(run, kind, "x")).parent.glob("*.pt")):
                stat = file.stat()
                out.append({
                    "checkpoint_id": f"{kind}/{file.stem}", "checkpoint_type": ckpt_type,
                    "time": datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat(),
                    "tinker_path": CheckpointPath(run, kind, file.stem).uri, "size_bytes": stat.st_size,
                })  # fmt: skip
        return sorted(out, key=lambda c: c["time"])

    def read(self, owner: str, uri: str, kind: str, what: str) -> dict[str, Any]:
        """The payload saved at `uri` by this owner; a UserError naming the path if it is not theirs,
        is of another kind, or was never saved."""
        path = CheckpointPath.parse(uri)
        if path.kind != kind:
            raise UserError(f"{what} takes a tinker://<run>/{kind}/<name> path, not {uri!r}")
        file = self._file(owner, path)
        if not file.is_file():
            raise UserError(f"checkpoint {uri!r} does not exist")
        return torch.load(file, map_location="cpu", weights_only=True)
