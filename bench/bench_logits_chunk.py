"""Learner memory and time with and without chunked token logprobs (`learner.logits_chunk_tokens`, issue 39).

    .venv/bin/python bench/bench_logits_chunk.py [--vocab 151936] [--hidden 256] [--layers 2]
        [--rows 4] [--length 256] [--chunks none 1024 256] [--reps 3]

A Qwen2-shaped causal LM (Qwen2-0.5B's vocabulary and tied embeddings, a narrow trunk so a step is
quick; random weights) is built from a config into a temporary folder. Each case runs in a fresh
process (no allocator state carried over): the learner's own forward (`learner.forward.forward_scores`,
logprobs, entropy and values at temperature 0.7 of `--rows` x `--length` tokens, the last 7/8 of each
row the response) and the backward of a PPO-shaped loss on them, without DeepSpeed. Per case: step
seconds (median over `--reps`) and the peak RSS over the RSS before the step (sampled every 5 ms, the
largest over the reps), plus the largest logprob and gradient differences to the first case. The
machine should be quiet.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20


def _case(policy: str, chunk, rows: int, length: int, reps: int, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # transformers' progress bars
    sys.path.insert(0, str(ROOT))
    sys.path.insert(1, str(ROOT / "bench"))
    import numpy as np
    import torch
    from bench_export import PeakRSS

    from learner.batch import pack_trajectories
    from learner.forward import forward_scores
    from learner.model import PolicyWithValueHead
    from learner.trajectory import Trajectory

    torch.set_num_threads(1)
    model = PolicyWithValueHead.from_pretrained(policy, value_head_std=0.1, logits_chunk_tokens=chunk)
    vocab = model.policy.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = length // 8
    trajs = [
        Trajectory(
            rng.integers(0, vocab, prompt),
            rng.integers(0, vocab, length - prompt),
            np.zeros(length - prompt, np.float32),
            np.zeros(length - prompt, np.float32),
            0.0,
        )
        for _ in range(rows)
    ]
    batch = pack_trajectories(trajs, pad_id=0)
    sampler = PeakRSS()
    times, peaks = [], []
    try:
        for _ in range(reps):
            model.zero_grad(set_to_none=True)
            before = sampler.rss()
            sampler.reset()
            t0 = time.perf_counter()
            s = forward_scores(model, batch, 0.7, entropy=True)
            loss = -(s.logprobs * batch.mask).mean() - 0.01 * (s.entropy * batch.mask).mean()
            (loss + (s.values * batch.mask).pow(2).mean()).backward()
            times.append(time.perf_counter() - t0)
            peaks.append(max(sampler.peak, sampler.rss()) - before)
    finally:
        sampler.close()
    head = model.policy.get_output_embeddings().weight.grad
    out.put((statistics.median(times), max(peaks), s.logprobs.detach().numpy(), head.numpy().copy()))


def run_case(policy: str, chunk, rows: int, length: int, reps: int):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_case, args=(policy, chunk, rows, length, reps, out))
    p.start()
    result = out.get(timeout=3600)
    p.join(timeout=120)
    return result


def build_policy(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 27 // 4,  # Qwen2-0.5B's ratio (4864 / 896 ~ 5.4), rounded up
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 448),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--chunks", nargs="+", default=["none", "1024", "256"])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    chunks = [None if c == "none" else int(c) for c in args.chunks]
    with tempfile.TemporaryDirectory() as tmp:
        n = build_policy(Path(tmp), args.hidden, args.layers, args.vocab)
        tokens = args.rows * (args.length - args.length // 8)
        print(
            f"Qwen2-shaped, {n / 1e6:.1f}M parameters (vocabulary {args.vocab}, hidden {args.hidden}, "
            f"{args.layers} layers), {args.rows} x {args.length} tokens ({tokens} scored), float32, 1 thread; "
            f"one [scored, vocabulary] float32 tensor = {tokens * args.vocab * 4 / MB:.0f} MiB"
        )
        print(
            f"{'logits_chunk_tokens':>20} {'step s':>8} {'peak RSS +MiB':>14} {'max |dlogp|':>12} {'max |dW|':>10}"
        )
        first = None
        for chunk in chunks:
            secs, peak, logp, grad = run_case(tmp, chunk, args.rows, args.length, args.reps)
            first = first if first is not None else (logp, grad)
            dlp = float(abs(logp - first[0]).max())
            dw = float(abs(grad - first[1]).max())
            print(f"{str(chunk):>20} {secs:8.2f} {peak / MB:14.0f} {dlp:12.2e} {dw:10.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
