"""`python -m cluster.plot`: a valid PNG of a run's curves from its metrics.jsonl."""

from __future__ import annotations

import json
import struct

import pytest

pytest.importorskip("matplotlib")

from cluster.plot import main  # noqa: E402
from cluster.reporting.curves import PANELS, panels, plot_run, series  # noqa: E402


def _rows() -> list[dict]:
    rows = [{"step": 0, "eval/reward_mean": 0.3, "eval/accuracy": 0.3}]
    for step in range(1, 7):
        rows.append(
            {
                "step": step,
                "rollout/reward_mean": 0.3 + 0.1 * step,
                "objective/kl": 0.01 * step,
                "throughput/samples_per_s": 20.0 + step,
            }
        )
    rows[3]["eval/accuracy"] = 0.6
    rows[6]["objective/kl"] = float("nan")  # non-finite points are left out, not plotted as gaps
    rows.append({"step": 6, "eval/reward_mean": 0.9, "eval/accuracy": 0.8})  # the final held-out row
    return rows


def test_plot_writes_a_png_of_the_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    out = plot_run(tmp_path)
    data = out.read_bytes()
    assert out == tmp_path / "curves.png"
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1500, 700)  # figsize (15, 7) at 100 dpi
    assert len(data) > 10_000  # drawn panels, not an empty canvas


def test_the_held_out_panel_gains_every_pass_at_k_the_run_evaluated():
    rows = [{"step": 0, "eval/accuracy": 0.3, "eval/pass@1": 0.3, "eval/pass@16": 0.9, "eval/pass@4": 0.7}]
    held_out = dict(panels(rows))["held-out"]
    assert [k for k, _label in held_out][-2:] == ["eval/pass@4", "eval/pass@16"]
    assert "eval/pass@1" not in [k for k, _label in held_out]  # pass@1 is the accuracy
    assert len(panels(rows)) == len(PANELS) == 6


def test_series_keeps_the_finite_points_of_a_key():
    assert series(_rows(), "eval/accuracy") == ([0, 3, 6], [0.3, 0.6, 0.8])  # before, step 3, after
    assert series(_rows(), "objective/kl") == ([1, 2, 3, 4, 5], [0.01, 0.02, 0.03, 0.04, 0.05])


def test_cli_names_a_missing_run_folder(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 1.0}) + "\n")
    assert main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"
