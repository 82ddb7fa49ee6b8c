"""`rollout.weight_transport: cuda_ipc` where no GPU is: which transport a group's placement gets
(`cluster.weights.transport_choice`, a pure function of where the members run), the refusals of an
explicit transport that cannot apply, and what of the IPC code runs without a device (its refusals on
the learner's and the receiver's side). The IPC push itself has not run on a GPU yet."""

from __future__ import annotations

import threading

import pytest
import torch
from demo_run import CONFIG

from cluster.config.schema import ConfigError, load_config
from cluster.weights.transport_choice import (
    MemberPlace,
    TransportChoice,
    TransportRefused,
    choose_transport,
)
from kernel import cuda_ipc
from learner.weight_broadcast import open_group, plan_layout, send_header
from rollout_workers.weight_receiver import WeightGroupError, WeightGroupMember

GPU0, GPU1 = "GPU-0a1b", "GPU-9f8e"


def places(*where: tuple[str, str | None]) -> list[MemberPlace]:
    return [MemberPlace(f"m{i}", node, dev) for i, (node, dev) in enumerate(where)]


def room_of(need: int, free: int):
    asked = []

    def room() -> tuple[int, int]:
        asked.append(True)
        return need, free

    room.asked = asked
    return room


def never():
    raise AssertionError("/dev/shm room asked where shared memory is not in question")


ONE_DEVICE = places(("n1", GPU0), ("n1", GPU0), ("n1", GPU0))


def test_auto_takes_cuda_ipc_on_one_device_and_runs_the_group_on_gloo():
    # NCCL would be the group's backend (GPU weights at both ends), but it refuses two ranks on one
    # device: the header goes over gloo
    assert choose_transport("auto", ONE_DEVICE, "nccl", never) == TransportChoice("cuda_ipc", "gloo")
    assert choose_transport("cuda_ipc", ONE_DEVICE, "nccl", never) == TransportChoice("cuda_ipc", "gloo")


@pytest.mark.parametrize(
    "where",
    [
        [("n1", GPU0), ("n1", GPU1)],  # two devices of one node
        [("n1", GPU0), ("n2", GPU0)],  # two nodes (the same UUID cannot be on two nodes; names only)
        [("n1", GPU0), ("n1", None)],  # a member without CUDA
    ],
)
def test_auto_falls_back_to_the_broadcast_off_one_device(where):
    assert choose_transport("auto", places(*where), "nccl", never) == TransportChoice("broadcast", "nccl")


def test_auto_on_cpu_weights_keeps_shared_memory_where_it_fits():
    cpu = places(("n1", None), ("n1", None))
    assert choose_transport("auto", cpu, "gloo", room_of(10, 100)) == TransportChoice("shared_memory", "gloo")
    assert choose_transport("auto", cpu, "gloo", room_of(100, 10)) == TransportChoice("broadcast", "gloo")
    # GPUs visible but CPU weights on one side (gloo): not CUDA IPC
    gpus_seen = places(("n1", GPU0), ("n1", GPU0))
    assert choose_transport("auto", gpus_seen, "gloo", room_of(1, 2)).transport == "shared_memory"
    two_nodes = places(("n1", None), ("n2", None))
    assert choose_transport("auto", two_nodes, "gloo", never) == TransportChoice("broadcast", "gloo")


def test_broadcast_asks_nothing():
    assert choose_transport("broadcast", ONE_DEVICE, "nccl", never) == TransportChoice("broadcast", "nccl")


@pytest.mark.parametrize(
    ("where", "backend", "reason"),
    [
        ([("n1", GPU0), ("n1", GPU0)], "gloo", "weights are on the CPU"),
        ([("n1", GPU0), ("n1", None)], "nccl", "torch.cuda is not available in m1"),
        ([("n1", GPU0), ("n2", GPU0)], "nccl", "on 2 nodes, not one"),
        ([("n1", GPU0), ("n1", GPU1), ("n1", GPU1)], "nccl", "on 2 CUDA devices, not one"),
    ],
)
def test_explicit_cuda_ipc_is_refused_where_it_cannot_apply(where, backend, reason):
    with pytest.raises(TransportRefused, match=r"rollout\.weight_transport='cuda_ipc'") as err:
        choose_transport("cuda_ipc", places(*where), backend, never)
    assert reason in str(err.value)


def test_explicit_shared_memory_is_refused_as_before():
    with pytest.raises(TransportRefused, match="on one node with CPU weights .gloo.; they are on 2 nodes"):
        choose_transport("shared_memory", places(("n1", None), ("n2", None)), "gloo", never)
    with pytest.raises(TransportRefused, match="backend nccl"):
        choose_transport("shared_memory", ONE_DEVICE, "nccl", never)
    with pytest.raises(TransportRefused, match="needs 95 MiB in the node's /dev/shm and 1 MiB are free"):
        choose_transport("shared_memory", places(("n1", None)), "gloo", room_of(95 * 2**20, 2**20))


def test_the_config_refuses_cuda_ipc_for_cpu_workers():
    with pytest.raises(ConfigError, match=r"rollout.weight_transport='cuda_ipc'.*num_gpus_per_worker > 0"):
        load_config(CONFIG, ["rollout.weight_transport=cuda_ipc", "rollout.weight_sync=collective"])
    cfg = load_config(
        CONFIG,
        [
            "rollout.weight_transport=cuda_ipc",
            "rollout.weight_sync=collective",
            "rollout.num_gpus_per_worker=0.5",
            "learner.num_gpus_per_rank=1",
            "cluster.placement=separate",
        ],
    )
    assert cfg.rollout.weight_transport == "cuda_ipc"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a machine without CUDA")
def test_without_cuda_the_ipc_code_refuses_by_name():
    from learner.cuda_ipc_bundle import CudaIpcSegment

    assert cuda_ipc.device_uuid() is None
    with pytest.raises(
        RuntimeError, match=r"rollout.weight_transport='cuda_ipc': torch.cuda is not available"
    ):
        CudaIpcSegment.create()
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        cuda_ipc.describe(torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a CUDA IPC description"):
        cuda_ipc.open_buffer({"kind": "shared_memory"})
    with pytest.raises(ValueError, match="torch.cuda is not available"):
        cuda_ipc.local_index(GPU0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the receiver's refusal on a machine without CUDA")
def test_a_receiver_off_the_device_refuses_the_header_and_leaves_the_group():
    """A real gloo weight group of two: rank 0 sends a header naming a CUDA buffer; the member cannot map
    it here and fails with WeightGroupError (the group is closed, to be formed again)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = plan_layout([("w", torch.float32, (4,), 0)], 1 << 20)
    description = {"kind": cuda_ipc.KIND, "bytes": layout.segment_bytes(), "device_uuid": GPU0, "handle": ""}
    sent, read = threading.Event(), threading.Event()

    def sender() -> None:
        group = open_group("127.0.0.1", port, 0, 2, 30.0)
        send_header(group, 3, layout, 30.0, "cpu", description)
        sent.set()
        read.wait(60)  # the group (and its store) lives until the member has read the header

    thread = threading.Thread(target=sender)
    thread.start()
    member = WeightGroupMember("127.0.0.1", port, 1, 2, 30.0)
    try:
        with pytest.raises(WeightGroupError, match="CUDA weight buffer cannot be opened here"):
            member.stream()
    finally:
        read.set()
        thread.join()
    assert sent.is_set()
    with pytest.raises(WeightGroupError, match="must be joined again"):
        member.stream()
