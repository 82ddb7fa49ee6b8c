"""Each tenant's metrics (cluster.serve.tenant_metrics) without a running service: the fold of several
forward_backward calls' metrics into one step's row, worked by hand; the rows a tenant's tracker run
(the real jsonl sink) writes per optim_step; the loggers the serve config takes. The service writing
them for real SDK calls: tests/test_tinker_service.py."""

from __future__ import annotations

import json

import pytest

from cluster.serve.tenant_metrics import TenantMetrics, TrackingSection, fold


def test_fold_sums_extremes_and_weights_the_mean_by_data_as_the_sdk_does():
    calls = [
        ({"loss:sum": 3.0, "lp:mean": -1.0, "len:max": 5.0, "len:min": 2.0, "only_here:sum": 1.0}, 2),
        ({"loss:sum": 1.5, "lp:mean": -4.0, "len:max": 7.0, "len:min": 3.0}, 1),
    ]
    # mean weighted by data: (-1 * 2 + -4 * 1) / 3 = -2; a key missing from a call is left out (the SDK's rule)
    assert fold(calls) == {"loss:sum": 4.5, "lp:mean": -2.0, "len:max": 7.0, "len:min": 2.0}
    assert fold([]) == {}


def test_fold_refuses_a_reduction_it_cannot_fold_naming_it():
    with pytest.raises(ValueError, match=r"metric 'gap:slack': reduction 'slack' is not one of"):
        fold([({"gap:slack": 0.5}, 1)])


def test_a_tenant_writes_one_row_per_optim_step_with_the_calls_since_the_last(tmp_path):
    metrics = TenantMetrics(TrackingSection(dir=str(tmp_path)))
    metrics.start("tml-key", "s1:train:0", {"base_model": "tiny", "lora_rank": 4})
    metrics.forward("s1:train:0")
    metrics.forward_backward("s1:train:0", {"loss:sum": 2.0}, data=2, tokens=9)
    metrics.forward_backward("s1:train:0", {"loss:sum": 1.0}, data=1, tokens=4)
    metrics.optim_step("s1:train:0", 1, {"grad_norm:mean": 0.25, "step:max": 1.0}, lr=0.05)
    metrics.forward_backward("s1:train:0", {"loss:sum": 0.5}, data=2, tokens=9)
    metrics.optim_step("s1:train:0", 2, {"grad_norm:mean": 0.125, "step:max": 2.0}, lr=0.01)
    metrics.forward_backward("s1:train:0", {"loss:sum": 9.0}, data=1, tokens=1)  # no step after it: no row
    metrics.close("s1:train:0")
    metrics.forward_backward("s1:train:0", {"loss:sum": 1.0}, data=1, tokens=1)  # a closed tenant: ignored

    path = metrics.folder("tml-key", "s1:train:0") / "metrics.jsonl"
    assert path.parent.parent.name != "tml-key" and ":" not in path.parent.name  # no key on disk
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"step": 1, "fb/loss:sum": 3.0, "fb/calls": 2, "fb/data": 3, "fb/tokens": 13, "forward/calls": 1,
         "optim/learning_rate": 0.05, "optim/grad_norm:mean": 0.25, "optim/step:max": 1.0},
        {"step": 2, "fb/loss:sum": 0.5, "fb/calls": 1, "fb/data": 2, "fb/tokens": 9, "forward/calls": 0,
         "optim/learning_rate": 0.01, "optim/grad_norm:mean": 0.125, "optim/step:max": 2.0},
    ]  # fmt: skip


def test_tracking_loggers_are_the_runs_names_but_prometheus_and_keep_the_record():
    assert TrackingSection(loggers=["jsonl", "tensorboard"]).loggers == ["jsonl", "tensorboard"]
    with pytest.raises(ValueError, match=r"'prometheus': its gauges are the trainer's named series"):
        TrackingSection(loggers=["jsonl", "prometheus"])
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['nope'\]; allowed: jsonl, tensorboard"):
        TrackingSection(loggers=["jsonl", "nope"])
    with pytest.raises(ValueError, match="'jsonl' must be listed"):
        TrackingSection(loggers=["tensorboard"])
