"""The agent gateway against the same worker driven directly, side by side in one run.

    .venv/bin/python bench/bench_gateway.py [--sessions 1 8 32] [--calls 6] [--max-tokens 32]   (make bench-gateway)

One rollout worker (hf engine) holds a GPT-2 on the calculator demo's chat tokenizer (random weights,
sized so that the engine's forward passes dominate as in a real run). For each concurrency C:
- direct: C prompts per engine call (`RolloutWorker.generate_ids`), `calls` rounds: what the gateway
  can at best achieve when C sessions call at once;
- gateway: C sessions at once, each `calls` sequential chat calls through the real `openai.AsyncOpenAI`
  client over HTTP on 127.0.0.1 (one connection pool, as the agent runners share; the clients run in a
  process of their own, as runners do, on the same 2 cores as the server).
Printed: completion tokens/s of each side, their ratio, and per-call latency p50/p99 of each side with
the gateway's added latency. Both sides sample the same way (the run's temperature, `max_tokens` each
call, EOS allowed). Nothing is asserted; the harness waits for an idle machine first.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402
from bench_async import wait_for_idle  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from demos.calculator_corpus import chat_tokenizer  # noqa: E402
from rollout_workers.config import GatewayConfig, RolloutConfig, SamplingConfig  # noqa: E402
from rollout_workers.worker import RolloutWorker  # noqa: E402

MESSAGES = [{"role": "user", "content": "37*48="}]


def build_policy(folder: Path, n_embd: int, n_layer: int) -> str:
    tok = chat_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok), n_positions=256, n_embd=n_embd, n_layer=n_layer, n_head=4,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def direct(worker: RolloutWorker, prompt: list[int], concurrency: int, calls: int, limit: int) -> dict:
    sampling = worker.config.sampling.model_copy(update={"n": 1})
    tokens, latencies = 0, []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for k in range(calls):
        t = time.perf_counter()
        outputs, _ = worker.generate_ids(
            [np.asarray(prompt)] * concurrency, sampling, k, frozenset(), [limit] * concurrency
        )
        latencies += [time.perf_counter() - t] * concurrency
        tokens += sum(len(o[0].response_ids) for o in outputs)
    cpu = time.process_time() - cpu0
    return {
        "tokens_s": tokens / (time.perf_counter() - t0),
        "latencies": latencies,
        "cpu": cpu,
        "tokens": tokens,
    }


async def _clients(base: str, keys: list[str], calls: int, limit: int) -> tuple[int, list[float], float]:
    """Each key's session makes `calls` sequential chat calls, all sessions at once (in the client process)."""
    shared = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256))  # as the runners do
    latencies: list[float] = []
    tokens = 0

    async def one(key: str) -> None:
        nonlocal tokens
        # not closed: closing the client would close the shared pool
        client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, http_client=shared)
        for _ in range(calls):
            t = time.perf_counter()
            answer = await client.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=limit)
            latencies.append(time.perf_counter() - t)
            tokens += answer.usage.completion_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in keys))
    return tokens, latencies, time.perf_counter() - t0


def _client_process(
    base: str, keys: list[str], calls: int, limit: int
) -> tuple[int, list[float], float, float]:
    """(tokens, latencies, seconds, the client process's CPU seconds)."""
    cpu0 = time.process_time()
    tokens, latencies, seconds = asyncio.run(_clients(base, keys, calls, limit))
    return tokens, latencies, seconds, time.process_time() - cpu0


def through_gateway(worker: RolloutWorker, pool, concurrency: int, calls: int, limit: int) -> dict:
    """The sessions' clients run in another process (as agent runners do), so they share the cores but
    not the server's interpreter."""
    gateway = worker._gateway.gateway
    sessions = [gateway.open_session(prompt_index=i) for i in range(concurrency)]
    base = worker._gateway.url + "/v1"
    cpu0 = time.process_time()
    tokens, latencies, seconds, client_cpu = pool.submit(
        _client_process, base, [s.key for s in sessions], calls, limit
    ).result()
    cpu = time.process_time() - cpu0
    for s in sessions:
        s.end("done")
    gateway.take([s.id for s in sessions])
    return {
        "tokens_s": tokens / seconds,
        "latencies": latencies,
        "cpu": cpu,
        "client_cpu": client_cpu,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--calls", type=int, default=6, help="sequential calls per session")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--no-wait", action="store_true", help="skip waiting for an idle machine")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    path = build_policy(folder, args.n_embd, args.n_layer)
    config = RolloutConfig(
        sampling=SamplingConfig(max_new_tokens=args.max_tokens),
        gateway=GatewayConfig(max_sessions=max(args.sessions), max_batch=max(args.sessions)),
        torch_threads=2,
    )
    worker = RolloutWorker(path, config)
    worker.start_gateway("bench")
    prompt = worker._gateway.gateway._render(MESSAGES, None)
    direct(worker, prompt, 4, 2, args.max_tokens)  # warm-up: first-call costs on neither side
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    through_gateway(worker, pool, 4, 2, args.max_tokens)
    if not args.no_wait:
        wait_for_idle()
    rows = []
    for c in args.sessions:
        d = direct(worker, prompt, c, args.calls, args.max_tokens)
        g = through_gateway(worker, pool, c, args.calls, args.max_tokens)
        rows.append((c, d, g))
    print(
        f"policy: GPT-2 n_embd={args.n_embd} n_layer={args.n_layer}, hf engine, {args.calls} calls per session, "
        f"max_tokens {args.max_tokens}; batches {worker._gateway.gateway.stats()['batches']}"
    )
    print(
        "| sessions | direct tokens/s | gateway tokens/s | ratio | direct p50 / p99 s | gateway p50 / p99 s "
        "| added p50 / p99 s | server CPU beyond direct, ms/call | client CPU, ms/call |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c, d, g in rows:
        dp = (percentile(d["latencies"], 50), percentile(d["latencies"], 99))
        gp = (percentile(g["latencies"], 50), percentile(g["latencies"], 99))
        n = c * args.calls
        # the server's CPU for the gateway side, less the direct side's for as many tokens: the gateway's own
        extra = (g["cpu"] - d["cpu"] * g["tokens"] / max(d["tokens"], 1)) / n * 1e3
        print(
            f"| {c} | {d['tokens_s']:.0f} | {g['tokens_s']:.0f} | {g['tokens_s'] / d['tokens_s']:.2f} | "
            f"{dp[0]:.3f} / {dp[1]:.3f} | {gp[0]:.3f} / {gp[1]:.3f} | {gp[0] - dp[0]:.3f} / {gp[1] - dp[1]:.3f} | "
            f"{extra:.1f} | {g['client_cpu'] / n * 1e3:.1f} |"
        )
    worker._gateway.close()
    pool.shutdown()


if __name__ == "__main__":
    main()
