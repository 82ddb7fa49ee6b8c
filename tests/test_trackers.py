"""The run's loggers for real, without Ray: JSONL, TensorBoard (its own event reader), W&B offline (its
transaction log read back) and MLflow against a real local server (read back with MlflowClient)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from wandb_records import read_offline_run

from cluster.config.sections import RunSection
from cluster.reporting.trackers.base import EVAL_AFTER, RUN, RunInfo, StepRow, flatten
from cluster.reporting.trackers.run_logger import RunLogger

CONFIG = {"run": {"name": "t", "steps": 4}, "learner": {"lr": 1e-5, "kl": {"coef": 0.05}}}
AFTER = {"eval/accuracy": 0.9}  # the held-out evaluation of the final weights


def rows(steps: range, offset: float = 0.0) -> list[StepRow]:
    return [
        StepRow(s, {"rollout/reward_mean": s / 10 + offset, "objective/kl": 0.01 * s, "loss/value": math.nan})
        for s in steps
    ]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory):
    import mlflow_server

    proc, url = mlflow_server.start(tmp_path_factory.mktemp("mlflow"))
    yield url
    mlflow_server.stop(proc)


def info(run_dir: Path, settings: RunSection, resume_step=None, resume_ids=None) -> RunInfo:
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunInfo(
        name="t",
        run_id=run_dir.name,
        run_dir=run_dir,
        config=CONFIG,
        settings=settings,
        resume_step=resume_step,
        resume_ids=resume_ids or {},
    )


def log_run(run: RunInfo, names: list[str], steps: range, offset: float = 0.0) -> RunLogger:
    log = RunLogger(names)
    log.open(run)
    (run.run_dir / "curves.png").write_bytes(_png())
    for row in rows(steps, offset):
        log.step(row)
    log.step(StepRow(steps[-1], AFTER, held_out_only=True))  # as the trainer ends: a row, then the summary
    log.summary(EVAL_AFTER, AFTER)
    log.summary(RUN, {"steps": float(steps[-1])})
    log.artifact(run.run_dir / "curves.png")
    log.close()
    return log


def _png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def jsonl_steps(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step, a step's rows merged (the last step's: its training row and the final evaluation)."""
    out: dict[int, dict] = {}
    for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        out.setdefault(r.pop("step"), {}).update(r)
    return out


def tensorboard_steps(run_dir: Path) -> dict[int, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    out: dict[int, dict] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.setdefault(e.step, {})[tag] = e.value
    return out


def mlflow_steps(client, run_id: str, keys: list[str]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for key in keys:
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            out.setdefault(m.step, {})[key] = m.value  # the latest value of a step wins
    return out


def step_keys(table: dict[int, dict]) -> dict[int, dict]:
    """The step rows' own keys (TensorBoard also holds the summaries, as `<part>/<key>` at the last step)."""
    return {
        s: {k: v for k, v in r.items() if k in ("rollout/reward_mean", "objective/kl", "loss/value", *AFTER)}
        for s, r in table.items()
    }


def assert_same(got: dict[int, dict], want: dict[int, dict]) -> None:
    """The same steps, each with the same metrics (TensorBoard keeps float32)."""
    assert sorted(got) == sorted(want)
    for step, row in want.items():
        assert got[step] == pytest.approx(row, rel=1e-6), step


def finite(table: dict[int, dict]) -> dict[int, dict]:
    return {
        s: {k: v for k, v in r.items() if isinstance(v, float | int) and math.isfinite(v)}
        for s, r in table.items()
    }


def test_wandb_offline_and_tensorboard_get_every_record(tmp_path, wandb_offline):
    run_dir = tmp_path / "run-a"
    settings = RunSection(
        loggers=["jsonl", "tensorboard", "wandb"], wandb={"mode": "offline", "tags": ["demo"]}
    )
    log = log_run(info(run_dir, settings), settings.loggers, range(1, 4))
    assert not log.dropped
    want = finite(jsonl_steps(run_dir))
    assert set(want) == {1, 2, 3} and want[2]["rollout/reward_mean"] == pytest.approx(0.2)
    assert want[3] == pytest.approx({"rollout/reward_mean": 0.3, "objective/kl": 0.03, **AFTER})  # 2 rows
    tb = tensorboard_steps(run_dir)
    assert_same(step_keys(tb), want)  # finite values only: loss/value is NaN
    assert tb[3]["eval_after/eval/accuracy"] == pytest.approx(0.9) and tb[3]["run/steps"] == 3
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    wb = read_offline_run(folder)
    assert wb.run_id == log.ids["wandb"] and wb.tags == ["demo"]
    assert_same(finite(wb.history), want)
    assert wb.config["learner"] == CONFIG["learner"]
    assert wb.summary["eval_after/eval/accuracy"] == 0.9 and wb.summary["run/steps"] == 3
    assert "curves.png" in wb.files and (folder / "files" / "curves.png").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {"eval_after": {"eval/accuracy": 0.9}, "run": {"steps": 3.0}}


def test_tensorboard_and_wandb_resume_the_same_run(tmp_path, wandb_offline):
    """A run that logged steps 1-4, resumed from its step-2 checkpoint: TensorBoard purges 3-4 and shows the
    resumed rows; W&B continues the same run id in a second offline folder."""
    run_dir = tmp_path / "run-b"
    settings = RunSection(loggers=["jsonl", "tensorboard", "wandb"], wandb={"mode": "offline"})
    first = log_run(info(run_dir, settings), settings.loggers, range(1, 5))
    log_run(info(run_dir, settings, 2, first.ids), settings.loggers, range(3, 6), offset=1.0)
    tb = tensorboard_steps(run_dir)
    assert tb[2]["rollout/reward_mean"] == pytest.approx(0.2)
    assert tb[4]["rollout/reward_mean"] == pytest.approx(1.4)  # the resumed run's, not the crashed one's
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    runs = [read_offline_run(f) for f in folders]
    assert len(runs) == 2 and {r.run_id for r in runs} == {first.ids["wandb"]}
    assert sorted(runs[1].history) == [3, 4, 5]


@pytest.mark.slow  # starts an MLflow server (~15 s)
def test_all_four_sinks_hold_the_same_step_metrics_and_mlflow_resumes(tmp_path, wandb_offline, mlflow_url):
    from mlflow import MlflowClient

    run_dir = tmp_path / "run-c"
    names = ["jsonl", "tensorboard", "wandb", "mlflow"]
    settings = RunSection(
        loggers=names, wandb={"mode": "offline"}, mlflow={"tracking_uri": mlflow_url, "experiment": "tests"}
    )
    first = log_run(info(run_dir, settings), names, range(1, 5))
    assert not first.dropped
    client = MlflowClient(tracking_uri=mlflow_url)
    run_id = first.ids["mlflow"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-c"
    assert run.data.params == {k: str(v) for k, v in flatten(CONFIG).items()}
    assert run.data.metrics["eval_after/eval/accuracy"] == 0.9
    assert [a.path for a in client.list_artifacts(run_id)] == ["curves.png"]
    artifact = Path(client.download_artifacts(run_id, "curves.png", str(tmp_path)))
    assert artifact.read_bytes() == (run_dir / "curves.png").read_bytes()

    keys = ["rollout/reward_mean", "objective/kl", *AFTER]
    want = finite(jsonl_steps(run_dir))
    assert want[4]["eval/accuracy"] == 0.9  # the final evaluation: a point of the last step
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    for got in (
        step_keys(tensorboard_steps(run_dir)),
        finite(read_offline_run(folder).history),
        mlflow_steps(client, run_id, keys),
    ):
        assert_same(got, want)

    # resumed from the step-2 checkpoint, with a config changed since (params keep their first value)
    changed = RunInfo(
        **{
            **info(run_dir, settings, 2, first.ids).__dict__,
            "config": {**CONFIG, "run": {"name": "t", "steps": 5}},
        }
    )
    second = log_run(changed, names, range(3, 6), offset=1.0)
    assert second.ids["mlflow"] == run_id and not second.dropped
    assert client.get_run(run_id).data.params["run.steps"] == "4"
    history = mlflow_steps(client, run_id, keys)
    assert sorted(history) == [1, 2, 3, 4, 5]
    assert history[4]["rollout/reward_mean"] == pytest.approx(1.4)  # the resumed run's value is the latest
    assert len(client.get_metric_history(run_id, "rollout/reward_mean")) == 7  # 4 first + 3 resumed


def test_a_failing_tracker_is_reported_once_and_dropped(tmp_path, monkeypatch, caplog):
    """MLflow's server is gone (nothing listens at the URI): the sink is dropped with one warning, the run
    goes on, the JSONL holds every row."""
    import mlflow_server

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    run_dir = tmp_path / "run-d"
    gone = f"http://127.0.0.1:{mlflow_server.free_port()}"
    settings = RunSection(loggers=["jsonl", "tensorboard", "mlflow"], mlflow={"tracking_uri": gone})
    with caplog.at_level(logging.WARNING, logger="cluster.reporting.trackers.run_logger"):
        log = log_run(info(run_dir, settings), settings.loggers, range(1, 4))
    assert list(log.dropped) == ["mlflow"]
    warnings = [r for r in caplog.records if "'mlflow' dropped" in r.getMessage()]
    assert len(warnings) == 1
    assert sorted(jsonl_steps(run_dir)) == [1, 2, 3] and sorted(tensorboard_steps(run_dir)) == [1, 2, 3]


def test_a_resume_cuts_later_rows_and_keeps_a_finished_runs_final_evaluation(tmp_path):
    """A finished 2-step run's metrics.jsonl: the held-out rows before and after training are told from
    training rows. Resumed from its step-2 checkpoint (to end again, or to go on), the final evaluation's
    row stays, as it stays in MLflow (issue 56 item 12; the resumed run's end writes its own after it);
    from step 1, step 2's rows go."""
    from cluster.reporting.metrics import held_out_only, read_metrics, truncate_metrics

    before = {"step": 0, "eval/accuracy": 0.1, "eval/pass@4": 0.2, "time/eval": 1.0}
    step1 = {"step": 1, "rollout/reward_mean": 0.2, "eval/accuracy": 0.3, "time/eval": 1.0}
    step2 = {"step": 2, "rollout/reward_mean": 0.4, "objective/kl": 0.01}
    after = {"step": 2, "eval/accuracy": 0.5, "eval/pass@4": 0.7, "time/eval": 1.0}
    rows = [before, step1, step2, after]
    assert [held_out_only(r) for r in rows] == [True, False, False, True]
    path = tmp_path / "metrics.jsonl"
    for last_step, kept in ((3, rows), (2, rows), (1, rows[:2])):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert truncate_metrics(path, last_step) == kept == read_metrics(path), last_step


def test_a_finished_run_resumed_to_go_on_tells_the_same_story_in_mlflow_and_the_jsonl(tmp_path, mlflow_url):
    """Issue 56 item 12: a finished 4-step run resumed from its last checkpoint to 6 steps, its metrics.jsonl
    cut as `Run.restore` cuts it. Every (step, metric) of MLflow's history is in metrics.jsonl with the
    same latest value (the first run's final evaluation at step 4 included), and MLflow's params hold the
    resumed run's changed settings beside the first run's."""
    from mlflow import MlflowClient

    from cluster.reporting.metrics import truncate_metrics

    run_dir = tmp_path / "run-f"
    names = ["jsonl", "mlflow"]
    settings = RunSection(loggers=names, mlflow={"tracking_uri": mlflow_url, "experiment": "resumes"})
    first = log_run(info(run_dir, settings), names, range(1, 5))
    truncate_metrics(run_dir / "metrics.jsonl", 4)  # Run.restore from the step-4 checkpoint
    more = {**CONFIG, "run": {"name": "t", "steps": 6}, "learner": {"lr": 2e-5, "kl": {"coef": 0.05}}}
    resumed = RunInfo(**{**info(run_dir, settings, 4, first.ids).__dict__, "config": more})
    log_run(resumed, names, range(5, 7), offset=1.0)

    client = MlflowClient(tracking_uri=mlflow_url)
    run_id = first.ids["mlflow"]
    summaries = ("eval_after/", "run/")
    keys = [k for k in client.get_run(run_id).data.metrics if not k.startswith(summaries)]
    assert "eval/accuracy" in keys
    jsonl = finite(jsonl_steps(run_dir))
    assert mlflow_steps(client, run_id, keys) == {
        s: {k: r[k] for k in keys if k in r} for s, r in jsonl.items()
    }
    assert jsonl[4]["eval/accuracy"] == 0.9 and jsonl[6]["eval/accuracy"] == 0.9
    params = client.get_run(run_id).data.params
    assert params["run.steps"] == "4" and params["learner.lr"] == "1e-05"  # MLflow params never change
    assert params["resumed/step_4/run.steps"] == "6" and params["resumed/step_4/learner.lr"] == "2e-05"
    assert not any(
        k.startswith("resumed/") and k.split("/", 2)[2] not in ("run.steps", "learner.lr") for k in params
    )


@pytest.mark.slow  # a real run on the tests' tiny models (Ray, one DeepSpeed rank), then its resume
def test_a_run_and_its_resume_put_the_same_step_metrics_in_all_four(
    ray_local, tmp_path, tiny_policy_dir, tiny_reward_dir, wandb_offline, mlflow_url, monkeypatch
):
    from types import SimpleNamespace

    from demo_run import CONFIG, demo_overrides
    from mlflow import MlflowClient

    from cluster.pipeline.checkpoint import latest_checkpoint, read_state
    from cluster.train import main

    prompts = tmp_path / "prompts.jsonl"
    words = ["the movie was", "i loved it", "the plot is", "a film and", "the acting was", "it is very"]
    prompts.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    tiny = SimpleNamespace(policy=tiny_policy_dir, prompts=prompts, reward=tiny_reward_dir)
    run_dir = tmp_path / "run-e"

    def sets(steps: int) -> list[str]:
        extra = {
            "run.loggers": "[jsonl,tensorboard,wandb,mlflow]",
            "run.wandb.mode": "offline",
            "run.mlflow.tracking_uri": mlflow_url,
            "run.mlflow.experiment": "e2e",
            "checkpoint.every_steps": 1,
            "data.prompts_per_step": 2,
            "rollout.chunk_size": 2,
            "rollout.sampling.max_new_tokens": 4,
            "learner.micro_batch_size": 2,
            "cluster.placement": "colocated",  # the demo's own placement: one process for every role
        }
        return sum((["--set", s] for s in demo_overrides(tiny, steps, **extra)), [])

    assert main([str(CONFIG), "--run-dir", str(run_dir), *sets(1)]) == 0
    ids = read_state(latest_checkpoint(run_dir))["trackers"]
    assert set(ids) == {"wandb", "mlflow"}
    assert main([str(CONFIG), "--resume", str(run_dir), *sets(2)]) == 0
    assert read_state(latest_checkpoint(run_dir))["trackers"] == ids  # the same tracker runs, continued

    want = finite(jsonl_steps(run_dir))
    assert sorted(want) == [1, 2]
    keys = sorted(want[1])
    tb = tensorboard_steps(run_dir)
    assert_same({s: {k: v for k, v in r.items() if k in keys} for s, r in tb.items() if s in want}, want)
    wb: dict[int, dict] = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        run = read_offline_run(folder)
        assert run.run_id == ids["wandb"]
        wb.update(finite(run.history))
    assert_same(wb, want)
    client = MlflowClient(tracking_uri=mlflow_url)
    assert_same(mlflow_steps(client, ids["mlflow"], keys), want)
    artifacts = {a.path for a in client.list_artifacts(ids["mlflow"])}
    assert {"config.yaml", "startup.json", "curves.png"} <= artifacts
    summary = client.get_run(ids["mlflow"]).data.metrics
    assert summary["run/steps"] == 2 and any(k.startswith("startup/") for k in summary)


def test_run_loggers_are_checked_with_the_field_and_the_allowed_values():
    from demo_run import CONFIG

    from cluster.config.schema import ConfigError, load_config

    cfg = load_config(CONFIG, ["run.loggers=[jsonl,wandb,mlflow]", "run.wandb.tags=[a]"])
    assert cfg.run.loggers == ["jsonl", "wandb", "mlflow"] and cfg.run.wandb.tags == ["a"]
    for override, message in (
        (
            "run.loggers=[jsonl,neptune]",
            r"run\.loggers: .*unknown logger\(s\) \['neptune'\]; allowed: jsonl, tensorboard",
        ),
        ("run.loggers=[tensorboard]", r"run\.loggers: .*'jsonl' must be listed"),
        ("run.loggers=[jsonl,jsonl]", r"run\.loggers: .*listed twice"),
        ("run.tensorboard=false", r"run\.tensorboard was replaced by run\.loggers"),
        ("run.wandb.mode=cloud", r"run\.wandb\.mode: .*'online' or 'offline'"),
        ("run.mlflow.uri=x", r"run\.mlflow\.uri"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(CONFIG, [override])


def test_each_registered_sink_loads_the_class_of_its_name_and_names_a_real_extra():
    """`SINKS` names its classes as `module:Class`: each loads to a `Sink` whose `name` is its key,
    and a package a sink needs is one of the project's pip extras."""
    import tomllib

    from cluster.config.sinks import SINKS, missing_packages
    from cluster.reporting.trackers.base import Sink

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for entry in SINKS:
        name = entry.name
        cls = entry.load()
        assert issubclass(cls, Sink) and cls.name == name
        assert (entry.package is None) == (entry.extra is None) and (
            entry.extra is None or entry.extra in extras
        )
    assert missing_packages(list(SINKS.names())) == []  # the dev venv has every extra
