"""Learner resources as config: one GPU per rank validated, CPU offload mapped to DeepSpeed's config and
its CPU Adam, and the bucketing that bounds weight-export memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from learner.config import LearnerConfig
from learner.deepspeed_setup import build_optimizer, ds_config
from learner.gather import buckets, cpu_state_dict, group_tied


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_gpus_per_rank": 0.5}, r"num_gpus_per_rank must be 0 \(CPU, gloo\) or 1 .* got 0\.5"),
        ({"num_gpus_per_rank": 2}, r"num_gpus_per_rank must be 0 \(CPU, gloo\) or 1 .* got 2"),
        ({"backend": "nccl"}, r"backend='nccl' needs learner\.num_gpus_per_rank: 1"),
        (
            {"backend": "gloo", "num_gpus_per_rank": 1},
            r"backend='gloo' trains on CPU: learner\.num_gpus_per_rank must be 0",
        ),
        ({"offload_params": True}, r"offload_params needs learner\.zero_stage: 3"),
    ],
)
def test_bad_learner_resources_name_the_field_and_allowed_values(kw, match):
    with pytest.raises(ValidationError, match=match):
        LearnerConfig(**kw)


def test_good_learner_resources_are_accepted():
    assert LearnerConfig(backend="nccl", num_gpus_per_rank=1).num_gpus_per_rank == 1
    assert LearnerConfig(num_gpus_per_rank=1).backend == "auto"
    assert LearnerConfig(zero_stage=3, offload_params=True, offload_optimizer=True).offload_params


@pytest.mark.slow
@pytest.mark.cpu_adam
def test_offload_maps_to_deepspeed_config_and_cpu_adam():
    base = ds_config(LearnerConfig())["zero_optimization"]
    assert "offload_optimizer" not in base and "offload_param" not in base
    zero = ds_config(LearnerConfig(zero_stage=3, offload_optimizer=True, offload_params=True))[
        "zero_optimization"
    ]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}  # gloo: no pinned buffers
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}

    model = torch.nn.Linear(3, 2)
    cfg = dict(lr=0.01, weight_decay=0.1, adam_betas=(0.8, 0.9), adam_eps=1e-6)
    assert type(build_optimizer(model, LearnerConfig(**cfg))) is torch.optim.AdamW
    cpu_adam = build_optimizer(
        model, LearnerConfig(offload_optimizer=True, **cfg)
    )  # JIT-builds cpu_adam once
    assert type(cpu_adam).__name__ == "DeepSpeedCPUAdam"
    group = cpu_adam.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["eps"]) == (0.01, 0.1, (0.8, 0.9), 1e-6)
    # The same decoupled-weight-decay update as torch AdamW, step by step.
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    torch_adam = build_optimizer(twin, LearnerConfig(**cfg))
    for step in range(3):
        for m, opt in ((model, cpu_adam), (twin, torch_adam)):
            opt.zero_grad()
            m(torch.arange(6.0).reshape(2, 3) * (step + 1)).square().sum().backward()
            opt.step()
        torch.testing.assert_close(model.weight, twin.weight, atol=1e-6, rtol=0)


def test_buckets_bound_the_bytes_and_keep_order():
    tensors = [("a", torch.zeros(10)), ("b", torch.zeros(20)), ("c", torch.zeros(100)), ("d", torch.zeros(5))]
    assert [[n for n, _ in b] for b in buckets(tensors, 4 * 30)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in buckets(tensors, 4 * 29)] == [["a"], ["b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in buckets(tensors, 4 * 30, element_bytes=8)] == [
        ["a"],
        ["b"],
        ["c"],
        ["d"],
    ]
    assert buckets([], 100) == []


def test_cpu_state_dict_keeps_names_order_and_ties():
    emb = torch.nn.Parameter(torch.randn(4, 3))
    state = {"wte": emb, "ln": torch.nn.Parameter(torch.ones(3)), "lm_head": emb, "buf": torch.arange(3)}
    assert [names for names, _ in group_tied(state)] == [["wte", "lm_head"], ["ln"], ["buf"]]
    out = cpu_state_dict(state, bucket_bytes=16, keep=True)
    assert list(out) == list(state) and out["wte"] is out["lm_head"]
    assert not out["wte"].requires_grad and out["wte"].data_ptr() != emb.data_ptr()
    assert all(torch.equal(out[k], state[k].detach()) for k in state)
    assert cpu_state_dict(state, bucket_bytes=16, keep=False) is None


def _in_a_child(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python process at the repo root (its own sys.modules and torch.distributed
    state, this one's untouched); it must exit 0."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_a_learner_rank_refuses_a_world_that_is_not_its_own():
    """DeepSpeed adopts a torch.distributed world that already exists in the process (vLLM's in-process
    engine makes one of size 1 when built first): the rank's init must refuse it, not train alone.
    In a child process, so this one's torch.distributed and DeepSpeed state stay untouched."""
    code = (
        "import torch.distributed as dist\n"
        "from learner.deepspeed_setup import free_port, init_distributed\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "try:\n"
        "    init_distributed(1, 2, '127.0.0.1', free_port(), 'gloo', 30)\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
        "finally:\n"
        "    dist.destroy_process_group()\n"
    )
    done = _in_a_child(code)
    assert "REFUSED learner rank 1 of 2: torch.distributed has rank 0 of a world of 1" in done.stdout, (
        done.stdout[-2000:]
    )


def test_a_rank_starts_without_importing_mlflow_and_mlflow_still_imports_after():
    """DeepSpeed's autotuner imports MLflow when it is installed (about 1 s of CPU per rank);
    `init_distributed` imports DeepSpeed without it, and MLflow stays importable in that process.
    In a child process, for a fresh sys.modules and torch.distributed state."""
    code = (
        "import sys, torch.distributed as dist\n"
        "from learner.deepspeed_setup import free_port, init_distributed\n"
        "init_distributed(0, 1, '127.0.0.1', free_port(), 'gloo', 30)\n"
        "print('AFTER-INIT', 'deepspeed' in sys.modules, 'mlflow' in sys.modules)\n"
        "import mlflow\n"
        "print('MLFLOW', bool(mlflow.__version__))\n"
        "dist.destroy_process_group()\n"
    )
    done = _in_a_child(code)
    assert "AFTER-INIT True False" in done.stdout and "MLFLOW True" in done.stdout, done.stdout[-2000:]
