"""Learner checkpoints load weights-only: a planted pickle payload is refused, real checkpoints round-trip.

The payload is first shown to be live (an unrestricted `torch.load` runs it and writes its marker),
so the refusal is the checkpoint engine's doing, not a dud payload's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_learner_ranks import _call, _config, _train, _trajectories, _weights, learner_group

from learner.safe_checkpoint import UnsafeCheckpointError

pytestmark = pytest.mark.slow


class _RunsCode:
    """Unpickling this runs `exec`, which writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('unpickled')",))


def _plant(ckpt: Path, pattern: str, marker: Path) -> str:
    """Replace the one file matching `pattern` in the checkpoint's tag folder with the payload."""
    (target,) = ckpt.glob(f"global_step*/{pattern}")
    torch.save({"module": {}, "optimizer_state_dict": {}, "payload": _RunsCode(marker)}, target)
    return target.name


@pytest.mark.parametrize("stage", [2, 3])
def test_planted_pickle_is_refused_and_real_checkpoints_round_trip(
    ray_local, tiny_policy_dir, tmp_path, stage
):
    ray = ray_local
    marker = tmp_path / "payload_ran"
    schedule = dict(lr_schedule="cosine", warmup_steps=2, lr_schedule_steps=8)  # 2 slots per PPO step
    config = _config(zero_stage=stage, checkpoint_format="deepspeed", **schedule)
    batch1, batch2 = _trajectories(6, seed=5), _trajectories(5, seed=6)
    with learner_group(ray, 1, tiny_policy_dir, config) as ranks:
        _train(ray, ranks, [batch1])
        ckpt = tmp_path / "ckpt"
        with pytest.raises(TypeError, match="client_state"):  # would not load weights-only later
            _call(ray, ranks, "save_checkpoint", (str(ckpt), {"bad": np.zeros(2)}))
        _call(ray, ranks, "save_checkpoint", (str(ckpt), {"data_position": 6}))
        saved, coef_saved = _weights(ray, ranks), _call(ray, ranks, "kl_coef")
        lr_first = _train(ray, ranks, [batch2])["train/lr"]
        w_first = _weights(ray, ranks)

        live = tmp_path / "live"
        shutil.copytree(ckpt, live)
        live_file = next(live.glob("global_step*")) / _plant(live, "*model_states.pt", tmp_path / "live_ran")
        torch.load(live_file, weights_only=False)
        assert (tmp_path / "live_ran").exists(), "the payload must run when unpickled without restriction"

        for i, pattern in enumerate(("*model_states.pt", "*optim_states.pt")):
            planted = tmp_path / f"planted{i}"
            shutil.copytree(ckpt, planted)
            name = _plant(planted, pattern, marker)
            with pytest.raises(UnsafeCheckpointError, match=f"refusing to load checkpoint file .*{name}"):
                _call(ray, ranks, "load_checkpoint", (str(planted),))
            assert not marker.exists(), f"the payload in {name} ran"

        assert _call(ray, ranks, "load_checkpoint", (str(ckpt),)) == [{"data_position": 6}]
        assert _call(ray, ranks, "kl_coef") == coef_saved
        w_loaded = _weights(ray, ranks)
        assert w_loaded.keys() == saved.keys()
        assert all(torch.equal(w_loaded[k], saved[k]) for k in saved)
        # Replaying the step lands on the same weights only if Adam moments, schedule and RNG came back.
        assert _train(ray, ranks, [batch2])["train/lr"] == lr_first == pytest.approx(1e-3)  # slot 2
        w_again = _weights(ray, ranks)
        for k in w_first:
            torch.testing.assert_close(w_again[k], w_first[k], atol=1e-7, rtol=0)


def test_consolidated_checkpoint_refuses_a_planted_pickle(ray_local, tiny_policy_dir, tmp_path):
    """The consolidated format's only pickle-format file (client state, KL controller, RNG) loads
    weights-only too; its tensors are safetensors, which hold no code."""
    from learner.consolidated_checkpoint import EXTRA

    ray = ray_local
    marker = tmp_path / "payload_ran"
    with learner_group(ray, 1, tiny_policy_dir, _config()) as ranks:
        _train(ray, ranks, [_trajectories(4, seed=11)])
        ckpt = tmp_path / "ckpt"
        _call(ray, ranks, "save_checkpoint", (str(ckpt), {"data_position": 4}))
        assert _call(ray, ranks, "load_checkpoint", (str(ckpt),)) == [{"data_position": 4}]
        torch.save({"client": {}, "payload": _RunsCode(marker)}, ckpt / EXTRA)
        with pytest.raises(UnsafeCheckpointError, match=f"refusing to load checkpoint file .*{EXTRA}"):
            _call(ray, ranks, "load_checkpoint", (str(ckpt),))
        assert not marker.exists()
