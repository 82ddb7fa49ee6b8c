"""Each metric name is declared once, by the part that produces it (`learner.metric_names`,
`cluster.reporting.metric_names`), and the code spells no name its producer did not declare: a
collision between producers, or a reader's typo, fails here instead of overwriting a number or
reading a curve that is never written."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cluster.reporting.metric_names import DRIVER_METRICS
from kernel.metric_names import MetricNames, collisions, merge_metrics
from learner.metric_names import LEARNER_METRICS

ROOT = Path(__file__).resolve().parent.parent
PRODUCERS = (LEARNER_METRICS, DRIVER_METRICS)
NAMESPACES = set().union(*(p.namespaces() for p in PRODUCERS))
SHAPE = re.compile(r"^([a-z_]+)/[\w@.]*$")
# modules whose "ns/x" strings are no metric names: the declarations, and MLflow's parameter names
NOT_METRICS = {
    "cluster/reporting/metric_names.py",
    "learner/metric_names.py",
    "cluster/reporting/trackers/mlflow_sink.py",
}


def declared_by(key: str) -> list[str]:
    return [p.producer for p in PRODUCERS if p.declares(key)]


def undeclared(row: dict) -> list[str]:
    """The keys of a step's row that no producer, or more than one, declares."""
    return sorted(k for k in row if k != "step" and len(declared_by(k)) != 1)


def spelled(path: Path) -> list[tuple[int, str, bool]]:
    """(line, name, whether it is only a prefix: an f-string's text before its first field) of every
    metric-shaped string in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text, prefix = node.value, node.value.endswith(("/", "_"))
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            text, prefix = str(node.values[0].value), True
        else:
            continue
        m = SHAPE.match(text)
        if m and m.group(1) in NAMESPACES:
            found.append((node.lineno, text, prefix))
    return found


def known(name: str, prefix: bool, producers: tuple[MetricNames, ...]) -> bool:
    if not prefix:
        return any(p.declares(name) for p in producers)
    return any(f.startswith(name) or name.startswith(f) for p in producers for f in p.families) or any(
        n.startswith(name) for p in producers for n in p.names
    )


def test_no_metric_name_is_declared_by_two_producers():
    assert collisions(PRODUCERS) == []


def test_the_collision_check_finds_a_shared_name_and_overlapping_families():
    a = MetricNames("a", frozenset({"rollout/reward_mean", "x/y"}), families=("env/",))
    b = MetricNames("b", frozenset({"rollout/reward_mean", "env/turns"}), families=("env/status/",))
    assert collisions([a, b]) == [
        "env/*: a and b",
        "env/turns: a and b",
        "rollout/reward_mean: a and b",
    ]


def test_a_rows_merge_refuses_a_name_two_parts_produce():
    assert merge_metrics({"a/x": 1.0}, {"b/y": 2.0}) == {"a/x": 1.0, "b/y": 2.0}
    with pytest.raises(ValueError, match=r"\['time/train'\] produced twice"):
        merge_metrics({"time/train": 1.0, "a/x": 1.0}, {"time/train": 0.5})


@pytest.mark.parametrize(
    ("package", "producers"),
    [("learner", (LEARNER_METRICS,)), ("cluster", PRODUCERS)],
    ids=["learner-writes-its-own", "cluster-writes-or-reads-declared"],
)
def test_every_metric_name_the_code_spells_is_declared(package, producers):
    """The learner spells only its own names; `cluster/` (which writes the driver's and reads both, for
    plots, telemetry, the summary and the checkpoint ranking) only declared ones."""
    bad = [
        f"{f.relative_to(ROOT)}:{line} {name!r}"
        for f in sorted((ROOT / package).rglob("*.py"))
        if str(f.relative_to(ROOT)) not in NOT_METRICS
        for line, name, prefix in spelled(f)
        if not known(name, prefix, producers)
    ]
    assert not bad, "\n".join(bad)


def test_the_spelling_check_sees_constants_and_f_strings(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        'm = {"rollout/reward_mean": 1, "rollout/rewardmean": 2, f"staleness/hist_{k}": 3}\nlabel = "samples/s"\n'
    )
    found = {(name, prefix) for _line, name, prefix in spelled(f)}
    assert found == {("rollout/reward_mean", False), ("rollout/rewardmean", False), ("staleness/hist_", True)}
    assert known("rollout/reward_mean", False, PRODUCERS) and not known(
        "rollout/rewardmean", False, PRODUCERS
    )
    assert known("staleness/hist_", True, PRODUCERS)
