"""Where agents outside the cluster find a run's gateways (`agent.runners: external`): the run folder's
`gateways.json`, `{"run": ID, "model": NAME, "ended": false, "gateways": [{"worker", "url", "admin_key"}]}`.

Every rollout worker the run starts (at launch, scaled up, or a replacement) starts its gateway and is
added; a worker that is gone stays listed and refuses connections, which an agent skips
(`agent_runners.external` does). When the run ends, `ended` turns true. The file holds the gateways'
admin keys (they open and claim sessions): it is written readable by its owner only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ray

FILE = "gateways.json"


class GatewayBook:
    def __init__(self, run_dir: Path, run_id: str, model_name: str, timeout_s: float) -> None:
        self.path = Path(run_dir) / FILE
        self.run_id, self.model_name, self.timeout_s = run_id, model_name, timeout_s
        self.entries: dict[str, dict[str, str]] = {}
        self.ended = False

    def add(self, handle: Any, name: str) -> None:
        """Start `name`'s gateway (idempotent on the worker) and list it."""
        if name in self.entries:
            return
        info = ray.get(handle.start_gateway.remote(self.model_name), timeout=self.timeout_s)
        self.entries[name] = {"worker": name, "url": info["url"], "admin_key": info["admin_key"]}
        self._write()

    def close(self) -> None:
        self.ended = True
        self._write()

    def _write(self) -> None:
        body = {
            "run": self.run_id,
            "model": self.model_name,
            "ended": self.ended,
            "gateways": list(self.entries.values()),
        }
        temp = self.path.with_suffix(".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=1)
        os.replace(temp, self.path)  # a reader never sees half a file
