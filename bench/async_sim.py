"""A discrete-event model of the streaming pipeline, fed with costs measured on this machine, to project
the modes past it (more workers, longer and long-tailed generations). Pure Python; nothing runs.

A batch is `chunks` chunks; chunk c of a batch takes `gen[c]` seconds on one worker (long-tailed
workloads draw it), then `s` of scoring; a learner step trains `t`. Chunks of batch j may start once
version j - eta is published (AReaL's admission rule; eta = 0 is the sync pipeline). How new weights
reach the workers is the policy:
- 'between': each worker loads them before its next chunk (`u` seconds; the object-store path).
- 'drain': a broadcast to all workers at once: when a step ends no chunk starts until the chunks in
  flight finish, then `u` (the collective path without partial rollouts).
- 'partial': the broadcast cuts into the chunks in flight (`pipeline.partial_rollout`): publication takes
  `u`, and each chunk in flight then is delayed by `u` plus `r` (recomputing its KV cache).
Returned per run: learner steps per second, generator idle fraction, and the mean lag of a trained
token (learner version at training minus the version that sampled the token).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class SimResult:
    steps_per_s: float
    generator_idle: float
    token_lag: float


def longtail_lengths(rng: random.Random, n: int, longest: int = 10) -> list[int]:
    """`n` episode lengths in turns, P(k) proportional to 1/k^2 on 1..longest: median 1, longest ~10x it."""
    ks = list(range(1, longest + 1))
    return rng.choices(ks, weights=[1.0 / k**2 for k in ks], k=n)


def simulate(
    workers: int,
    gen: list[list[float]],
    s: float,
    t: float,
    u: float,
    eta: int,
    policy: str = "between",
    r: float = 0.0,
) -> SimResult:
    """`gen[j][c]`: seconds of chunk c of batch j on one worker (see the module docstring). Events in
    time order: chunk ends, learner step ends, broadcasts."""
    steps = len(gen)
    pending: list[tuple[int, float]] = []  # (batch, seconds) admitted, not handed out
    admitted = 0  # batches admitted
    version = 0  # published
    held = [0] * workers  # the version each worker holds ('between')
    run: list[dict | None] = [None] * workers  # the chunk each worker runs
    left = [len(g) for g in gen]  # chunks of each batch not yet finished
    ready_at = [0.0] * steps  # when each batch is scored (its last chunk + s)
    chunks: list[dict] = []
    now, busy, learner_end, trained, paused = 0.0, 0.0, None, 0, False
    last_pub = 0.0  # the learner's step ends when its weights are out: the next one starts after
    while trained < steps:
        while admitted < steps and admitted <= version + eta:  # the admission rule
            pending += [(admitted, g) for g in gen[admitted]]
            admitted += 1
        for w in range(workers):  # hand out chunks
            if run[w] is None and pending and not paused:
                b, g = pending.pop(0)
                start = now
                if policy == "between" and held[w] < version:
                    start, held[w] = now + u, version
                run[w] = {"batch": b, "start": start, "end": start + g, "marks": [(start, version)]}
        # the learner starts the next step when its batch is scored and the previous weights are out
        if learner_end is None and not paused and trained < steps and left[trained] == 0:
            learner_end = max(now, ready_at[trained], last_pub) + t
        ends = [(c["end"], w) for w, c in enumerate(run) if c is not None]
        candidates = [e for e, _w in ends] + ([learner_end] if learner_end is not None else [])
        now = min(candidates)
        for end, w in ends:
            if end == now:  # a chunk ends
                c = run[w]
                busy += c["end"] - c["start"]
                left[c["batch"]] -= 1
                ready_at[c["batch"]] = max(ready_at[c["batch"]], now + s)
                chunks.append(c)
                run[w] = None
        if learner_end == now:  # a step ends: publish its weights
            learner_end, trained = None, trained + 1
            if policy == "drain":
                paused = True
            else:
                version += 1
                last_pub = now + u
                if policy == "partial":  # cut into every chunk in flight
                    for c in run:
                        if c is not None:
                            c["end"] += u + r
                            c["marks"].append((now + u, version))
        if paused and all(c is None for c in run):  # drained: broadcast, then go on
            now += u  # time never runs back: now is at or after the step's end
            version, last_pub = version + 1, now
            paused = False
    wall = max(now, last_pub)  # the run ends when its last weights are out
    lag = sum(_token_lag(c) * (c["end"] - c["start"]) for c in chunks) / max(busy, 1e-9)
    return SimResult(steps / wall, max(0.0, 1.0 - busy / (workers * wall)), lag)


def _token_lag(chunk: dict) -> float:
    """Mean over the chunk's time (tokens spread evenly) of (training version - sampling version)."""
    b, start, end, marks = chunk["batch"], chunk["start"], chunk["end"], chunk["marks"]
    total = 0.0
    for (t0, v), nxt in zip(marks, [*marks[1:], (end, None)], strict=True):
        total += (b - min(v, b)) * (nxt[0] - t0)
    return total / max(end - start, 1e-9)


def projection(
    g_median: float,
    s: float,
    t: float,
    u: float,
    r: float,
    eta: int,
    chunk_prompts: int,
    steps: int = 100,
    seed: int = 0,
    longest: int = 10,
    scales: tuple[int, ...] = (1, 8, 64),
) -> list[tuple]:
    """(scale, workers, policy, SimResult) for 1..64 workers on a long-tailed workload: each step trains
    one chunk per worker, a chunk of `chunk_prompts` episodes takes `g_median` x its longest episode's
    turns (1..`longest`), times each of `scales` (1: as measured; 64: reasoning-length turns; the KV
    recompute `r` scales with it). The same draws for every policy; 'sync' is 'between' at eta = 0."""
    out = []
    for scale in scales:
        for w in (1, 2, 4, 8, 16, 32, 64):
            rng = random.Random(seed)
            gen = [
                [scale * g_median * max(longtail_lengths(rng, chunk_prompts, longest)) for _ in range(w)]
                for _ in range(steps)
            ]
            for policy, e in (("sync", 0), ("between", eta), ("drain", eta), ("partial", eta)):
                rule = "between" if policy == "sync" else policy
                out.append((scale, w, policy, simulate(w, gen, s, t, u, e, rule, r * scale)))
    return out
