"""Advantage whitening across ranks equals whitening the whole batch in one place.

Kept in its own light module: the spawned ranks import it, so it must not pull in transformers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from learner.algorithms import masked_whiten
from learner.deepspeed_setup import free_port
from learner.prepare import distributed_whiten


def _whiten_worker(rank: int, port: int, xs, masks, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        queue.put((rank, distributed_whiten(xs[rank], masks[rank]).numpy()))
        queue.put((rank + 2, distributed_whiten(xs[rank], masks[rank], shift_mean=False).numpy()))
    finally:
        dist.destroy_process_group()


def test_whitening_across_two_ranks_equals_whitening_the_concatenated_batch():
    gen = torch.Generator().manual_seed(0)
    # Uneven shards with different response lengths; NaN in padding must not leak.
    xs = [torch.randn(3, 5, generator=gen) * 3 + 1, torch.randn(2, 7, generator=gen) * 3 + 1]
    masks = [torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]), torch.zeros(2, 7)]
    masks[1][0, :7] = 1
    masks[1][1, :2] = 1
    xs[0][0, 4] = float("nan")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_whiten_worker, args=(r, port, xs, masks, queue)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        # Plain numpy results (tensors would travel as shared memory that dies with the child).
        out = {k: torch.from_numpy(v) for k, v in (queue.get(timeout=60) for _ in range(4))}
        for p in procs:
            p.join(timeout=60)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()

    big_x = torch.zeros(5, 7)
    big_m = torch.zeros(5, 7)
    big_x[:3, :5], big_m[:3, :5] = xs[0], masks[0]
    big_x[3:], big_m[3:] = xs[1], masks[1]
    for shift, offset in ((True, 0), (False, 2)):
        expected = masked_whiten(big_x, big_m, shift_mean=shift)
        torch.testing.assert_close(out[offset + 0], expected[:3, :5], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[offset + 1], expected[3:], atol=1e-5, rtol=1e-5)
