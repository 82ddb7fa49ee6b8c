"""The demo on a 3-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: one raylet per
node, each with its own CPUs and custom resources), driven by `python -m cluster.train` with
`cluster.address` as a user would: roles pinned to node types through the config, the node holding
the rollout worker killed mid-run, the 3 x 1-CPU plan that failed in issue 10, and a plan no
state of the cluster can hold failing at once with the free resources per node."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from demo_run import CONFIG, SMALL_STEPS, demo_overrides, prompt_file
from ray.cluster_utils import Cluster
from ray.core.generated import common_pb2

from cluster.prompts.loader import PromptStream

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
OBJECT_STORE = 128 * 2**20  # per node; the demo's objects are small
WAIT = 900.0  # the machine is shared: every wait is on an event, with room to spare


@contextlib.contextmanager
def ray_cluster(*nodes: dict, system_config: dict | None = None):
    """A head node and more, each {'num_cpus': .., 'resources': {..}}; always shut down.
    `system_config`: Ray's internal settings for the whole cluster (given to the head)."""
    head = {**nodes[0], "object_store_memory": OBJECT_STORE, "include_dashboard": False}
    if system_config:
        head["_system_config"] = system_config
    cluster = Cluster(initialize_head=True, head_node_args=head, shutdown_at_exit=False)
    try:
        added = [cluster.add_node(**n, object_store_memory=OBJECT_STORE) for n in nodes[1:]]
        cluster.wait_for_nodes(timeout=120)
        yield cluster, [cluster.head_node, *added]
    finally:
        # Each node's processes, not Cluster.shutdown(): that also resets this process's Ray client
        # state, which the session's local Ray (conftest.ray_local) may still be using.
        for node in [*cluster.worker_nodes, cluster.head_node]:
            cluster.remove_node(node)


def start_run(
    cluster: Cluster, run_dir: Path, log: Path, overrides: list[str], release: Path | None = None
) -> subprocess.Popen:
    """`cluster.train` on `cluster`; with `release`, its learner held until that file exists (tests/held_train.py)."""
    sets = [*overrides, f"cluster.address={cluster.address}"]
    entry = (
        ["-m", "cluster.train"] if release is None else [str(REPO / "tests" / "held_train.py"), str(release)]
    )
    cmd = [sys.executable, *entry, str(CONFIG), "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return log.read_text()


def actors_by_name(cluster: Cluster, run_id: str | None = None) -> dict[str, dict]:
    """Every actor the cluster has seen (dead ones too), or the run `run_id`'s only (the run id is the
    run folder's name): member name (the run id prefix of `<run id>/<member>` dropped) -> {'State',
    'NodeID', 'Pid'}."""
    table = cluster.global_state.actor_table(None)
    prefix = "" if run_id is None else f"{run_id}/"
    return {
        a["Name"].split("/", 1)[-1]: {"State": a["State"], "NodeID": a["Address"]["NodeID"], "Pid": a["Pid"]}
        for a in table.values()
        if a["Name"] and a["Name"].startswith(prefix)
    }


def finished_since(cluster: Cluster, method: str, since_ns: int) -> int:
    """How many calls of actor method `method` finished after `since_ns` (time.time_ns), from the
    task events Ray's GCS keeps (reported about once a second; no dashboard needed)."""
    done = common_pb2.TaskStatus.Value("FINISHED")
    return sum(
        1
        for e in cluster.global_state._get_all_task_events()
        if e.task_info.func_or_class_name.endswith(f".{method}")
        and e.state_updates.state_ts_ns.get(done, 0) > since_ns
    )


def wait_for(what: str, check, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"no {what} within {WAIT:.0f}s")


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def small_demo(assets, tmp_path: Path, steps: int, **extra) -> list[str]:
    """`steps` steps of 8 prompts over an epoch of exactly steps x 8 prompts."""
    return demo_overrides(
        assets,
        steps,
        **{**SMALL_STEPS, "data.prompts_path": prompt_file(assets, tmp_path, steps * 8), **extra},
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_roles_on_their_node_types_survive_losing_the_rollout_node(demo_assets, tmp_path, mode):
    """In async mode samples stay in the object store of the node that generated them: objects under
    Ray's inline limit (100 KB) travel inside their reference instead, so the limit is lowered to
    1 KB here (a 4-sample chunk of the demo is ~2.5 KB), as real responses exceed 100 KB. The
    reference and the scorer share the rollout node in async mode, so until the learner reads them
    the only copies of a chunk's samples and reference logprobs are on that node (a scorer
    elsewhere would have fetched a copy Ray recovers them from). The driver holds the learner from
    the start (an injected `learner_gate`, tests/held_train.py), so every chunk scored before
    the node is removed is unread by construction: its objects are lost, the learner says so, they
    are generated again, and every prompt drawn is still trained exactly once (or is outstanding)."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    release = tmp_path / "release-learner"
    steps = 4
    scoring = "rollout_node" if mode == "async" else "reward_node"
    pins = {
        "pipeline.mode": mode,
        "learner.resources": "{learner_node: 1}",
        "rollout.resources": "{rollout_node: 1}",
        "reference.resources": f"{{{scoring}: 1}}",
        "reward.resources": f"{{{scoring}: 1}}",
        "checkpoint.every_steps": 2,
    }
    held = mode == "async"
    with ray_cluster(
        {"num_cpus": 1, "resources": {"reward_node": 2}},  # head: reference and reward scorer (sync)
        {"num_cpus": 1, "resources": {"learner_node": 1}},
        {"num_cpus": 1, "resources": {"rollout_node": 3}},
        system_config={"max_direct_call_object_size": 1024} if held else None,
    ) as (cluster, (head, learner_node, rollout_node)):
        proc = start_run(
            cluster, run_dir, log, small_demo(demo_assets, tmp_path, steps, **pins), release if held else None
        )
        try:
            roles = ("learner-rank-0", "rollout-worker-0", "reference-0", "reward-scorer-0")
            control = "rayppo-control-run"  # the run's control actor, named after the run folder

            def started():
                actors = actors_by_name(cluster)
                alive = all(actors.get(n, {}).get("State") == "ALIVE" for n in (*roles, control))
                return actors if alive else None

            actors = wait_for("every role and the control actor started", started, proc, log)
            assert actors["learner-rank-0"]["NodeID"] == learner_node.node_id
            assert actors["rollout-worker-0"]["NodeID"] == rollout_node.node_id
            scoring_node = rollout_node if mode == "async" else head
            assert actors["reference-0"]["NodeID"] == scoring_node.node_id
            assert actors["reward-scorer-0"]["NodeID"] == scoring_node.node_id
            # The control actor (no resources) lives with the driver, on the head node.
            assert actors[control]["NodeID"] == head.node_id
            if held:
                wait_for(
                    "a chunk scored while the learner is held",
                    lambda: finished_since(cluster, "sample_logprobs", 0) >= 1,
                    proc,
                    log,
                )
                assert steps_done(run_dir) == 0
                cluster.remove_node(rollout_node)
                release.touch()
            else:
                wait_for("a finished step", lambda: steps_done(run_dir) >= 1, proc, log)
                cluster.remove_node(rollout_node)  # mid-run: step 2 is generating or about to
            replacement_node = cluster.add_node(
                num_cpus=1, resources={"rollout_node": 3}, object_store_memory=OBJECT_STORE
            )
            out = finish(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out[-4000:]
        if held:
            assert f"learner held until {release} exists" in out, out[-4000:]
        actors = actors_by_name(cluster)

    # The worker's bundle moved to the node that joined; its replacement ran there.
    assert actors["rollout-worker-0"]["State"] == "DEAD"
    replacements = sorted(
        (n for n in actors if n.startswith("rollout-worker-0.r")), key=lambda n: int(n.rsplit(".r", 1)[1])
    )  # the GCS lists actors by id, not by age: the newest is the one with the highest restart count
    assert replacements and actors[replacements[-1]]["NodeID"] == replacement_node.node_id, actors
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), out[-4000:]
    assert sum(r["faults/actor_replacements"] for r in rows) >= 1, out[-4000:]
    if mode == "async":  # the chunks scored while the learner was held were generated again
        assert sum(r["faults/lost_chunks"] for r in rows) >= 1, out[-4000:]

    # Every prompt drawn from the stream trained exactly once or still outstanding, the lost chunks'
    # included. In sync mode that is the epoch, each prompt once; in async mode the stream may have
    # run into the next epoch while the lost chunks were generated again (their prompts go first,
    # but fresh samples generated ahead are trained before them), so some may still be outstanding.
    state = json.loads((run_dir / "checkpoints" / f"step-{steps:06d}" / "state.json").read_text())
    trained = collections.Counter({int(k): v for k, v in state["trained_prompts"].items()})
    run_cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    epoch = steps * 8
    drawn_n = state["stream"]["epoch"] * epoch + state["stream"]["offset"]
    drawn = PromptStream(list(range(epoch)), run_cfg["run"]["seed"], run_cfg["data"]["shuffle"]).next_batch(
        drawn_n
    )
    assert trained + collections.Counter(state.get("outstanding", [])) == collections.Counter(drawn), out[
        -4000:
    ]
    if mode == "sync":
        assert trained == {i: 1 for i in range(epoch)}, out[-4000:]

    # Where every file of the run went: all under the one run folder on the shared disk, written by
    # the driver (config, metrics, checkpoint state, tokenizer) and learner rank 0 (DeepSpeed
    # state, final model), whatever node each ran on.
    files = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}
    for step in (2, 4):
        ckpt = f"checkpoints/step-{step:06d}"
        assert {f"{ckpt}/state.json", f"{ckpt}/COMPLETE"} <= files
        assert any(f.startswith(f"{ckpt}/learner/") for f in files), files
    assert {"config.yaml", "metrics.jsonl", "final/config.json", "final/tokenizer_config.json"} <= files
    assert any(f.startswith("final/model") for f in files), files
    assert not any(".partial" in f for f in files)


@pytest.fixture(scope="module")
def three_one_cpu_nodes():
    """3 x 1 CPU, shared by the two plan tests below. The plan that cannot be placed runs first: it
    starts no actor and reserves nothing, so the cluster is as fresh for the plan that can."""
    one_cpu = {"num_cpus": 1}
    with ray_cluster(one_cpu, one_cpu, one_cpu) as (cluster, _nodes):
        yield cluster


def test_a_plan_no_node_layout_can_hold_fails_at_once_naming_free_resources(
    demo_assets, tmp_path, three_one_cpu_nodes
):
    """2.7 CPUs asked of 3 x 1 CPU, yet no layout holds them: each 0.8-CPU learner rank leaves
    0.2 of its node, too little for anything else, and the rest (1.1 CPUs) exceeds the third node.
    Ray would keep that group pending; the run fails before timeouts.actor_start_s, naming why.
    With cluster.autoscaling it waits actor_start_s for nodes instead."""
    cluster = three_one_cpu_nodes
    run_dir, log = tmp_path / "unplaceable", tmp_path / "run.log"
    plan = {
        "learner.num_ranks": 2,
        "learner.num_cpus_per_rank": 0.8,
        "rollout.num_workers": 2,
        "rollout.num_cpus_per_worker": 0.3,
        "timeouts.actor_start_s": 3600,  # an answer before this is not a timeout
    }
    proc = start_run(cluster, run_dir, log, small_demo(demo_assets, tmp_path, 1, **plan))
    out = finish(proc, log)
    assert proc.returncode == 1, out[-4000:]
    assert "cannot hold these bundles even when idle" in out
    assert "2 x learner-rank {CPU: 0.8}" in out and "2 x rollout-worker {CPU: 0.3}" in out
    assert out.count("CPU 1/1") == 3  # free/total of each node: nothing was reserved
    assert not actors_by_name(cluster, run_dir.name)  # no actor was started

    # Where nodes may join (cluster.autoscaling) the plan waits for them, up to actor_start_s,
    # then fails the same way and takes its pending group back.
    waiting = {**plan, "cluster.autoscaling": True, "timeouts.actor_start_s": 5}
    log = tmp_path / "waiting.log"
    proc = start_run(cluster, tmp_path / "waiting", log, small_demo(demo_assets, tmp_path, 1, **waiting))
    out = finish(proc, log)
    assert proc.returncode == 1, out[-4000:]
    assert "not placed within 5s (timeouts.actor_start_s)" in out and out.count("CPU 1/1") == 3
    groups = cluster.global_state.placement_group_table()
    assert groups and {g["state"] for g in groups.values()} == {"REMOVED"}


def test_the_learner_is_placed_when_three_one_cpu_nodes_hold_the_plan(
    demo_assets, tmp_path, three_one_cpu_nodes
):
    """Issue 10: 2.5 CPUs asked of 3 x 1 CPU. Small actors placed first, one per node, left no
    node a whole CPU for the learner; placed as one plan, the learner gets a node of its own."""
    cluster = three_one_cpu_nodes
    run_dir, log = tmp_path / "placed", tmp_path / "run.log"
    two_workers = {"rollout.num_workers": 2, "rollout.num_cpus_per_worker": 0.5}
    proc = start_run(cluster, run_dir, log, small_demo(demo_assets, tmp_path, 1, **two_workers))
    out = finish(proc, log)
    assert proc.returncode == 0, out[-4000:]
    actors = actors_by_name(cluster, run_dir.name)
    learner_node = actors["learner-rank-0"]["NodeID"]
    others = [
        a["NodeID"] for name, a in actors.items() if name.split("-")[0] in ("rollout", "reference", "reward")
    ]
    assert len(others) == 4 and learner_node not in others


TRANSPORT_CHECK = """
import sys, time
import pytest, ray
from cluster.weights.collective import CollectiveWeightSync
from cluster.weights.push import WeightSyncError

ray.init(address=sys.argv[1], log_to_driver=False)

@ray.remote(num_cpus=0)
class Member:
    def __init__(self, need=0):
        self.need = need

    def ping(self):
        return True

    def weight_segment_room(self, dtype):  # as LearnerRank's: (bytes needed, bytes free in /dev/shm)
        from learner.shared_bundle import room

        return self.need, room()

here = Member.options(resources={"a": 1}).remote()
there, there_too = (Member.options(resources={"b": 1}).remote() for _ in range(2))
too_big = Member.options(resources={"b": 1}).remote(1 << 60)
ray.get([m.ping.remote() for m in (here, there, there_too, too_big)])
deadline = time.monotonic() + 120
def shared(transport, ranks, workers, backend="gloo"):
    sync = CollectiveWeightSync(backend=backend, transport=transport)
    return sync._use_shared_memory(ranks, workers, [f"w{i}" for i in range(len(workers))], deadline, "bfloat16")
assert shared("auto", [there], [there_too])
assert shared("shared_memory", [there], [there_too])
assert not shared("auto", [here], [there]) and not shared("auto", [there], [here, there_too])
assert not shared("broadcast", [there], [there_too]) and not shared("auto", [there], [there_too], "nccl")
with pytest.raises(WeightSyncError, match="on one node with CPU weights .gloo.; they are on 2 nodes"):
    shared("shared_memory", [there], [here])
assert not shared("auto", [too_big], [there])  # no room in /dev/shm: the broadcast
with pytest.raises(WeightSyncError, match="needs .* MiB in the node's /dev/shm and .* MiB are free"):
    shared("shared_memory", [too_big], [there])
print("transport checked")
"""


def test_the_collective_path_shares_memory_only_within_one_node(tmp_path):
    """`rollout.weight_transport`: 'auto' takes shared memory only when every learner rank and worker is
    on one Ray node with CPU weights and its /dev/shm has room for the bundle; 'shared_memory' elsewhere
    is refused by name (real actors on a 2-node cluster, asked where they run)."""
    with ray_cluster({"num_cpus": 1, "resources": {"a": 1}}, {"num_cpus": 1, "resources": {"b": 3}}) as (
        cluster,
        _,
    ):
        script = tmp_path / "check.py"
        script.write_text(TRANSPORT_CHECK)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run(
            [sys.executable, str(script), cluster.address],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
    assert out.returncode == 0 and "transport checked" in out.stdout, (out.stdout + out.stderr)[-4000:]
