"""Learner throughput and memory at long-tail sequence lengths: padded count-based micro-batches vs a
token budget vs token budget + padding-free packing + ranks balanced by tokens (issue 22).

    .venv/bin/python bench/bench_learner.py [--hidden 896] [--layers 2] [--vocab 32768] [--seqs 24]
        [--median 24] [--tail 20] [--reps 2] [--baseline-repo PATH]

A Qwen2-shaped causal LM (Qwen2-0.5B's width, head layout and MLP ratio by default, fewer layers so a
step fits this 2-core machine; random weights) is built from a config into a temporary folder. Two
real DeepSpeed learner ranks (gloo, one process and one thread each, `learner.rank.LearnerRank`)
run `train_step` on the same batch for each case, one case after the other. Batches: 'long-tail'
(response lengths log-normal around `--median`, the longest exactly `--tail` x the median; prompts
8-48 tokens) and 'uniform' (every prompt 16 and response 24 tokens, like the demo). The batch is split
over the ranks as the driver does (`cluster.records.groups.shard_batch`, by count or by tokens).

Per case: tokens/s = real (prompt + response) tokens of the batch / the slower rank's step seconds
(median over `--reps`), and the larger rank's peak RSS over its RSS before the step (activations,
logits, gradients; the sampler reads RSS every 5 ms). `--baseline-repo`: a checkout of an older commit
whose learner runs one more row first, today's settings (padded, 8 rows, split by count) on that
code (e.g. `git worktree add /tmp/before <commit>`), so the table shows before/after in one run. The machine must be quiet: it waits for an idle machine first.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20

CASES = {  # name -> (LearnerConfig fields, balance_ranks)
    "padded, 8 rows": ({"micro_batch_size": 8}, "count"),
    "token budget": ({"max_tokens_per_micro_batch": 2048}, "count"),
    "budget+packed+balanced": ({"max_tokens_per_micro_batch": 2048, "pack_sequences": True}, "tokens"),
}


def _rank_main(rank: int, port: int, repo: str, policy: str, fields: dict, shard, reps: int, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    log = os.open(Path(policy) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 2)  # DeepSpeed's and transformers' chatter; shown if the rank fails
    sys.path.insert(0, repo)
    sys.path.insert(1, str(ROOT / "bench"))
    import torch.distributed as dist
    from bench_export import PeakRSS

    from learner.config import LearnerConfig
    from learner.rank import LearnerRank
    from learner.trajectory import Trajectory

    shard = [Trajectory(*fields_of) for fields_of in shard]  # built here: from `repo`'s learner
    config = LearnerConfig(dist_timeout_s=3600, ppo_epochs=1, **fields)
    learner = LearnerRank(rank, 2, policy, config, temperature=1.0)
    learner.setup("127.0.0.1", port)
    sampler = PeakRSS()
    rows = []
    try:
        for _ in range(reps):
            dist.barrier()
            before = sampler.rss()
            sampler.reset()
            t0 = time.perf_counter()
            learner.train_step(shard)
            rows.append((time.perf_counter() - t0, max(sampler.peak, sampler.rss()) - before))
    finally:
        sampler.close()
        learner.shutdown()
    out.put((rank, rows))


def run_ranks(target, rank_args, log_dir: str) -> dict:
    """Start `target(rank, port, *rank_args[rank], out)` for each rank in a spawned process (one
    torch.distributed world on a free port) and return what each put on `out` as `(rank, value)`, by
    rank. A rank that exits with an error kills the others; its log (`log_dir/rank<i>.log`, where the
    rank sends its stderr) is in the raised error."""
    import torch.multiprocessing as mp

    from learner.deepspeed_setup import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *a, out)) for r, a in enumerate(rank_args)]
    for p in procs:
        p.start()
    results: dict = {}
    while len(results) < len(procs):
        try:
            rank, value = out.get(timeout=5)
            results[rank] = value
        except queue.Empty:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                log = (Path(log_dir) / f"rank{failed[0]}.log").read_text()[-3000:]
                raise RuntimeError(f"learner rank {failed[0]} failed:\n{log}") from None
    for p in procs:
        p.join(timeout=120)
    return results


def run_case(repo: str, policy: str, fields: dict, shards, reps: int) -> tuple[float, float]:
    """(median seconds of the slower rank, largest peak extra RSS in MiB over ranks and reps)."""
    results = run_ranks(_rank_main, [(repo, policy, fields, shards[r], reps) for r in range(2)], policy)
    seconds = [max(results[0][i][0], results[1][i][0]) for i in range(reps)]
    extra = max(e for r in results.values() for _, e in r)
    return statistics.median(seconds), extra / MB


def build_policy(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(1, hidden // 64)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 5.43) // 64 * 64,  # Qwen2-0.5B: 896 -> 4864
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 7) if heads % 7 == 0 else 1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def make_batch(kind: str, n: int, median: int, tail: float, vocab: int, seed: int = 0):
    import numpy as np

    from learner.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    if kind == "uniform":
        p_lens, r_lens = np.full(n, 16), np.full(n, 24)
    else:
        p_lens = rng.integers(8, 49, size=n)
        r_lens = np.clip(np.round(median * np.exp(rng.normal(0.0, 0.8, size=n))), 2, None).astype(int)
        r_lens[np.argsort(r_lens)[n // 2]] = median  # the median is `median` ...
        r_lens[int(rng.integers(n))] = int(median * tail)  # ... and the longest `tail` x it
        r_lens = np.minimum(r_lens, int(median * tail))
    out = []
    for i, (p, r) in enumerate(zip(p_lens, r_lens, strict=True)):
        out.append(
            Trajectory(
                rng.integers(2, vocab, size=int(p)),
                rng.integers(2, vocab, size=int(r)),
                rng.normal(-10.0, 0.5, int(r)).astype(np.float32),
                rng.normal(-10.0, 0.5, int(r)).astype(np.float32),
                float(rng.normal()),
                group=i,
            )
        )
    return out


def shard(trajs, balance: str):
    from cluster.records.groups import shard_batch

    idx = shard_batch(
        [t.group for t in trajs], [len(t.prompt_ids) + len(t.response_ids) for t in trajs], 2, balance
    )
    # plain tuples: a rank process unpickles them before it can put a baseline checkout on its path
    return [[tuple(vars(trajs[k]).values()) for k in s] for s in idx]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seqs", type=int, default=24)
    ap.add_argument("--median", type=int, default=24)
    ap.add_argument("--tail", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--baseline-repo", type=str, default=None)
    ap.add_argument("--batches", nargs="+", default=["long-tail", "uniform"])
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors leave RSS (ranks inherit it)
    import torch
    from bench_async import wait_for_idle

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        n = build_policy(Path(tmp), args.hidden, args.layers, args.vocab)
        print(
            f"Qwen2-shaped model from config: {n / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, "
            f"vocab {args.vocab}), fp32; 2 ranks ZeRO-2, gloo, 1 thread each; {args.seqs} sequences per step"
        )
        print(
            f"{'batch':<10} {'case':<24} {'code':<9} {'tokens':>7} {'s/step':>7} {'tokens/s':>9} {'peak_extra_MiB':>14}"
        )
        for kind in args.batches:
            trajs = make_batch(kind, args.seqs, args.median, args.tail, args.vocab)
            tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
            cases = [(name, fields, balance, str(ROOT)) for name, (fields, balance) in CASES.items()]
            if args.baseline_repo:  # today's settings on the older code first
                cases.insert(0, ("padded, 8 rows", *CASES["padded, 8 rows"], args.baseline_repo))
            for name, fields, balance, repo in cases:
                wait_for_idle()
                sec, extra = run_case(repo, tmp, fields, shard(trajs, balance), args.reps)
                code = "baseline" if repo != str(ROOT) else "this"
                print(
                    f"{kind:<10} {name:<24} {code:<9} {tokens:>7} {sec:>7.2f} {tokens / sec:>9.0f} {extra:>14.0f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
