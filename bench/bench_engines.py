"""Rollout engines side by side on one policy: start-up, generation throughput, weight swap, memory.

    .venv-vllm/bin/python bench/bench_engines.py [--policy assets/sentiment_tiny/policy] [--big]

Each engine runs in its own fresh process (a `RolloutWorker`, as inside a Ray actor, with
`rollout.torch_threads` threads): start-up is the worker's constructor (vLLM: import included),
throughput is generated tokens per second over `--reps` calls of `--prompts` demo-like prompts
(n=1, temperature 1, `--new-tokens` tokens), a swap is `load_weights` of a full bundle including
its probe acknowledgement, and memory is the process tree's peak RSS. `--big` adds the swap time of
a ~124M-parameter GPT-2 built from a config (random weights). Prints a table; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + kids) / 1024.0


def _child(engine: str, policy: str, prompts: int, new_tokens: int, reps: int, threads: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_workers.config import RolloutConfig, SamplingConfig
    from rollout_workers.worker import RolloutWorker

    sampling = SamplingConfig(max_new_tokens=new_tokens)
    config = RolloutConfig(engine=engine, torch_threads=threads, sampling=sampling)
    t0 = time.perf_counter()
    worker = RolloutWorker(policy, config)
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = min(worker._engine.vocab_size, 512)
    batch = [rng.integers(3, vocab, size=int(rng.integers(4, 12))) for _ in range(prompts)]
    batch = [np.concatenate([[1], p]) for p in batch]  # BOS first, like the demo prompts
    worker.generate(list(range(prompts)), batch, seed=0)  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for rep in range(reps):
        tokens += sum(len(s.response_ids) for s in worker.generate(list(range(prompts)), batch, seed=rep + 1))
    gen_s = time.perf_counter() - t0
    bundle = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).state_dict()
    swaps = []
    for v in range(1, 4):
        t0 = time.perf_counter()
        worker.load_weights(bundle, v)
        swaps.append(time.perf_counter() - t0)
    return {
        "engine": engine,
        "start_s": start_s,
        "tokens_per_s": tokens / gen_s,
        "swap_s": sorted(swaps)[1],
        "peak_rss_mb": _peak_rss_mb(),
    }


def _big_policy(out: Path) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    src = ROOT / "assets" / "sentiment_tiny" / "policy"
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=256, vocab_size=32000)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0  # the demo tokenizer's ids
    GPT2LMHeadModel(cfg).save_pretrained(out)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    return str(out)


def _run(engine: str, policy: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--policy", policy]
    cmd += ["--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--reps", str(args.reps)]
    cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default=str(ROOT / "assets" / "sentiment_tiny" / "policy"))
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--big", action="store_true", help="also time swaps of a ~124M-parameter GPT-2")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(
            json.dumps(
                _child(args.child, args.policy, args.prompts, args.new_tokens, args.reps, args.threads)
            )
        )
        return 0
    rows = [dict(_run(e, args.policy, args), model="demo") for e in args.engines.split(",")]
    if args.big:
        with tempfile.TemporaryDirectory() as tmp:
            big = _big_policy(Path(tmp) / "gpt2-124m")
            small = argparse.Namespace(**{**vars(args), "prompts": 4, "new_tokens": 8, "reps": 1})
            rows += [dict(_run(e, big, small), model="gpt2-124M") for e in args.engines.split(",")]
    print(f"{'model':10} {'engine':6} {'start s':>8} {'tokens/s':>9} {'swap s':>7} {'peak RSS MiB':>13}")
    for r in rows:
        print(
            f"{r['model']:10} {r['engine']:6} {r['start_s']:8.1f} {r['tokens_per_s']:9.0f} "
            f"{r['swap_s']:7.3f} {r['peak_rss_mb']:13.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
