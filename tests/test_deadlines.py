"""Every wait loop of the driver ends: each loop in cluster/ that waits on the cluster (ray.wait,
wait_until, a sleep, a call tracker's wait) is bounded by a deadline, and a stuck one ends in
`cluster.records.deadlines.WaitTimeout` naming what it waited for and the setting that bounds it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cluster.records.calls import CallTracker
from cluster.records.deadlines import Deadline, WaitTimeout

ROOT = Path(__file__).resolve().parent.parent
WAITS = {"wait", "wait_until", "sleep"}  # the calls a driver loop waits in
# Loops that wait for ever on purpose, with the reason: nothing else may.
FOREVER = {
    "cluster/watch.py:main": "serves Prometheus until the user's Ctrl-C (python -m cluster.watch)",
    "cluster/serve/service.py:watch_heartbeats": "ends silent sessions for as long as the service runs; "
    "cancelled when the app shuts down (build_app's lifespan)",
}


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _bounded(loop: ast.While | ast.For) -> bool:
    """The loop names a deadline (a variable, field or argument called *deadline*), or its waits are a
    call tracker's, which takes the caller's idle `Deadline` as its first argument."""
    idents = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name)}
    idents |= {n.attr for n in ast.walk(loop) if isinstance(n, ast.Attribute)}
    if any("deadline" in i for i in idents):
        return True
    waits = [c for c in _calls(loop) if _name(c) in WAITS]
    return all(_name(c) == "wait" and (c.args or c.keywords) for c in waits)


def wait_loops(root: Path) -> dict[str, bool]:
    """`file:function` of every loop under root/cluster that waits -> whether it is bounded."""
    out: dict[str, bool] = {}
    for f in sorted((root / "cluster").rglob("*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for loop in ast.walk(fn):
                if isinstance(loop, ast.While | ast.For) and any(_name(c) in WAITS for c in _calls(loop)):
                    key = f"{f.relative_to(root)}:{fn.name}"
                    out[key] = out.get(key, True) and _bounded(loop)
    return out


def test_every_wait_loop_of_the_driver_has_a_deadline():
    loops = wait_loops(ROOT)
    # the loops this rule is about are found (the checker sees them)
    for key in (
        "cluster/pipeline/stream_pipeline.py:step",
        "cluster/pipeline/collector.py:_gather",
        "cluster/pipeline/learner_calls.py:_results",
        "cluster/records/ray_waits.py:wait_until",
        "cluster/scale.py:_via_job_api",
    ):
        assert key in loops, key
    unbounded = sorted(k for k, ok in loops.items() if not ok and k not in FOREVER)
    assert unbounded == [], f"wait loops without a deadline: {unbounded}"
    assert set(FOREVER) <= set(loops)  # an exemption that no longer exists is removed


def test_the_checker_finds_a_loop_that_polls_without_a_deadline(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "x.py").write_text(
        "import time\n"
        "def spin(t, d):\n"
        "    while not t.done:\n"
        "        t.wait()\n"
        "def bounded(t, idle):\n"
        "    while not t.done:\n"
        "        t.wait(idle)\n"
        "def sleepy(deadline):\n"
        "    while time.monotonic() < deadline:\n"
        "        time.sleep(1)\n"
    )
    assert wait_loops(tmp_path) == {
        "cluster/x.py:spin": False,
        "cluster/x.py:bounded": True,
        "cluster/x.py:sleepy": True,
    }


def test_a_tracker_with_nothing_in_flight_ends_in_an_error_naming_the_wait():
    """Nothing tracked: nothing can finish. The caller's idle deadline ends the poll, naming what it
    waited for, the setting and what it saw (no Ray call is made with nothing tracked)."""
    idle = Deadline("step 7 of the async pipeline", "timeouts.generate_s", 0.2)
    tracker = CallTracker()
    with pytest.raises(WaitTimeout) as err:
        while True:  # the driver's loop: wait, handle what finished, wait again
            assert tracker.wait(idle, lambda: "0 of 4 prompts ready") == []
    assert str(err.value) == (
        "step 7 of the async pipeline not done within 0.2s (timeouts.generate_s): 0 of 4 prompts ready"
    )


@pytest.mark.slow
def test_a_stuck_async_step_ends_in_its_deadline_naming_what_it_waited_for(ray_local, demo_assets, tmp_path):
    """A real async run whose buffer can admit nothing (every slot taken, nothing in flight): the step's
    loop used to poll every 50 ms for ever; it ends after timeouts.generate_s in a WaitTimeout that names
    the step, the setting and the buffer's state."""
    from demo_run import CONFIG, SMALL_STEPS, demo_overrides

    from cluster.config.schema import load_config
    from cluster.pipeline.run import Run

    extra = {**SMALL_STEPS, "pipeline.mode": "async", "pipeline.max_staleness": 0, "timeouts.generate_s": 5}
    trainer = Run(load_config(CONFIG, demo_overrides(demo_assets, 2, **extra)), tmp_path / "run")
    try:
        trainer.pipeline.buffer.admitted = 8  # step 1's slots all used, no prompt ever handed out
        with pytest.raises(
            WaitTimeout,
            match=r"step 1 of the async pipeline not done within 5s \(timeouts\.generate_s\): no call in flight and no batch for the learner: 0 of 8 prompts ready.* 0 prompts admissible at v0",
        ):
            trainer.iteration()
    finally:
        trainer.close()
