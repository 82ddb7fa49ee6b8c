"""The service's checkpoint store (`cluster.serve.checkpoints`) on a folder, without a service: per API
key, atomic, and refusing malformed tinker:// paths by name."""

from __future__ import annotations

import re

import pytest
import torch


def test_checkpoint_store_is_per_key_atomic_and_checks_paths(tmp_path):
    """Files land under sha256(key)[:16] (no key on disk), no temporary file is left, another key reads
    "does not exist", a name is not overwritten unless asked, and malformed paths are refused by name."""
    import hashlib

    from cluster.serve.checkpoints import CheckpointPath, CheckpointStore
    from cluster.serve.futures import UserError

    store = CheckpointStore(str(tmp_path))
    where = CheckpointPath("s1:train:0", "weights", "step-2")
    assert (
        store.write("tml-a", where, {"x": torch.arange(3)}, overwrite=False)
        == "tinker://s1:train:0/weights/step-2"
    )
    files = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [hashlib.sha256(b"tml-a").hexdigest()[:16] + "/s1:train:0/weights/step-2.pt"]
    assert store.read("tml-a", where.uri, "weights", "load")["x"].tolist() == [0, 1, 2]
    with pytest.raises(UserError, match=re.escape(f"checkpoint {where.uri!r} does not exist")):
        store.read("tml-b", where.uri, "weights", "load")
    with pytest.raises(UserError, match="exists"):
        store.write("tml-a", where, {}, overwrite=False)
    store.write("tml-a", where, {"x": torch.zeros(1)}, overwrite=True)
    assert store.read("tml-a", where.uri, "weights", "load")["x"].tolist() == [0.0]
    with pytest.raises(UserError, match="takes a tinker://<run>/sampler_weights/<name> path"):
        store.read("tml-a", where.uri, "sampler_weights", "create_sampling_session")
    for bad in (
        "tinker://s1/weights/../x",
        "tinker://s1/other/x",
        "file:///etc/passwd",
        "tinker://s1/weights",
    ):
        with pytest.raises(UserError, match="is not tinker://"):
            CheckpointPath.parse(bad)
    with pytest.raises(UserError, match="no checkpoint_dir"):
        CheckpointStore(None).read("tml-a", where.uri, "weights", "load")
