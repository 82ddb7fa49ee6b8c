"""One model size's measurement for `bench_scale.py`: its learner ranks and rollout workers as Ray
actors, one learner step (RSS at rest and the step's peak), the weight pushes per (engine, path) (a
warm-up, then timed pushes: seconds, GB/s, peak RSS of the worker and learner rank 0), and stopping
every actor so the next size starts from a clean machine."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

MIB = 2**20


def make_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> list:
    """`n` trajectories of random tokens (ids from 3: past the special ids), one group each."""
    import numpy as np

    from learner.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            rng.integers(3, vocab, size=prompt_len),
            rng.integers(3, vocab, size=response_len),
            rng.normal(-10.0, 0.5, response_len).astype(np.float32),
            rng.normal(-10.0, 0.5, response_len).astype(np.float32),
            float(rng.normal()),
            group=i,
        )
        for i in range(n)
    ]


def worker_key(engine: str, lora_sync: str) -> str:
    """A rollout worker's name in a size's actors and samplers: its engine, and `/adapter` for one
    built to apply adapters (rollout.lora_sync='adapter')."""
    return engine if lora_sync == "merged" else f"{engine}/{lora_sync}"


def pid_of(actor, timeout: float) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=timeout)


def stop_actors(actors: list, ranks: list, timeout: float) -> None:
    """Learner ranks leave their process group (and drop their /dev/shm buffers); then every actor is
    killed and its process waited for, so its memory is back before the next size."""
    import psutil
    import ray

    if ranks:
        try:
            ray.get([r.shutdown.remote() for r in ranks], timeout=min(timeout, 120))
        except Exception as err:  # a failed rank: killed below anyway
            print(f"learner shutdown: {err!r}", file=sys.stderr)
    procs = []
    for a in actors:
        with contextlib.suppress(Exception):  # dead already
            procs.append(psutil.Process(pid_of(a, 30)))
        ray.kill(a)
    psutil.wait_procs(procs, timeout=60)


class Size:
    """The actors and samplers of one size; `run` fills `rows`."""

    def __init__(self, name: str, policy: str, facts: dict, args, memcpy: float) -> None:
        self.name, self.policy, self.facts, self.args, self.memcpy = name, policy, facts, args, memcpy
        self.ranks: list = []
        self.workers: dict[str, object] = {}
        self.samplers: dict[str, object] = {}
        self.rows: list[dict] = []  # filled as it goes: a failure keeps the rows before it
        self.start_s: dict[str, float] = {}  # seconds to start (and set up) the learner and each worker

    def start_learner(self) -> None:
        import ray
        from bench_zero_memory import FIT
        from machine import PeakRSS

        from learner.config import LearnerConfig, LoRAConfig
        from learner.rank import LearnerRank

        a = self.args
        lora = LoRAConfig(rank=a.lora_rank, alpha=2.0 * a.lora_rank) if a.lora_rank else LoRAConfig()
        cfg = LearnerConfig(
            lora=lora,
            zero_stage=3,
            dtype="float32",
            backend="gloo",
            torch_threads=a.threads,
            ppo_epochs=1,
            micro_batch_size=a.micro_batch,
            dist_timeout_s=a.timeout,
            **(FIT if a.fit else {}),
        )
        t0 = time.perf_counter()
        actor = ray.remote(LearnerRank).options(num_cpus=1)
        self.ranks = [actor.remote(r, 2, self.policy, cfg) for r in range(2)]
        host, port = ray.get(self.ranks[0].node_address.remote(), timeout=a.timeout)
        ray.get([r.setup.remote(host, port) for r in self.ranks], timeout=a.timeout)
        self.start_s["learner"] = time.perf_counter() - t0
        for r, rank in enumerate(self.ranks):
            self.samplers[f"rank{r}"] = PeakRSS(pid_of(rank, a.timeout))

    def start_worker(self, engine: str, lora_sync: str = "merged") -> None:
        import ray
        from machine import PeakRSS

        from rollout_workers.config import RolloutConfig, VLLMConfig
        from rollout_workers.worker import RolloutWorker

        a = self.args
        # vLLM's KV cache on CPU is 0.25 GiB by default: max_model_len as the cluster sets it (prompt +
        # response), not the model's own limit (131072 positions for Qwen2-0.5B would not fit).
        vllm = VLLMConfig(max_model_len=a.prompt_tokens + a.response_tokens)
        if lora_sync == "adapter":
            vllm.max_lora_rank = a.lora_rank
        cfg = RolloutConfig(
            engine=engine, dtype=a.dtype, torch_threads=a.threads, vllm=vllm, lora_sync=lora_sync
        )
        t0 = time.perf_counter()
        worker = ray.remote(RolloutWorker).options(num_cpus=0.5).remote(self.policy, cfg)
        ray.get(worker.ping.remote(), timeout=a.timeout)
        key = worker_key(engine, lora_sync)
        self.start_s[key] = time.perf_counter() - t0
        self.workers[key] = worker
        self.samplers[key] = PeakRSS(pid_of(worker, a.timeout))

    def stop_worker(self, key: str) -> None:
        self.samplers.pop(key).close()
        stop_actors([self.workers.pop(key)], [], self.args.timeout)

    def export_adapters(self, on: bool) -> int:
        """Make the learner ranks export the adapter alone (learner.export_adapter, what the cluster sets
        from rollout.lora_sync='adapter') or the merged weights; returns the adapter's bytes at the
        rollout dtype (ZeRO-3's full sizes)."""
        import ray
        from scale_models import DTYPE_BYTES

        def flip(rank, value: bool) -> int:
            rank.config.export_adapter = value
            policy = rank.engine.module.policy
            return sum(
                getattr(p, "ds_numel", p.numel()) for n, p in policy.named_parameters() if ".lora_" in n
            )

        counts = ray.get([r.__ray_call__.remote(flip, on) for r in self.ranks], timeout=self.args.timeout)
        return counts[0] * DTYPE_BYTES[self.args.dtype]

    def learner_step(self) -> list[dict]:
        import ray

        a = self.args
        batch = make_batch(a.samples, a.prompt_tokens, a.response_tokens, self.facts["vocab_size"])
        half = len(batch) // 2
        shards = [batch[:half], batch[half:]]
        samplers = [self.samplers["rank0"], self.samplers["rank1"]]
        for s in samplers:
            s.reset()
        t0 = time.perf_counter()
        ray.get(
            [r.train_step.remote(sh) for r, sh in zip(self.ranks, shards, strict=True)], timeout=a.timeout
        )
        seconds = time.perf_counter() - t0
        return [
            {
                "size": self.name,
                "kind": "learner",
                "rank": r,
                "sequences": len(shards[r]),
                "tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in shards[r]),
                "step_s": seconds,
                "rest_rss_mib": s.base / MIB,
                "step_peak_over_rest_mib": s.extra() / MIB,
            }
            for r, s in enumerate(samplers)
        ]

    def failed_row(self, engine: str, path: str, lora_sync: str, error: str) -> dict:
        """The row of a push that could not run (its worker did not start)."""
        return {
            "size": self.name,
            "kind": "push",
            "path": path,
            "engine": engine,
            "dtype": self.args.dtype,
            "probe": True,
            "lora_sync": lora_sync if self.args.lora_rank else None,
            "bytes": 0,
            "error": error,
        }

    def push_row(
        self, engine: str, path: str, version: int, probe: bool, lora_sync: str = "merged"
    ) -> tuple[dict, int]:
        """One (engine, path, probe, lora_sync) row: a warm-up push and `reps` timed ones; returns it and
        the last version. `probe`: both sides score the probe sequences (else the push checks digests
        only); `lora_sync='adapter'`: the learner exports the adapter alone."""
        from cluster.weights.collective import CollectiveWeightSync
        from cluster.weights.push import push_weights

        a = self.args
        key = worker_key(engine, lora_sync)
        worker, wsamp, lsamp = self.workers[key], self.samplers[key], self.samplers["rank0"]
        adapter_bytes = self.export_adapters(lora_sync == "adapter") if a.lora_rank else 0
        nbytes = adapter_bytes if lora_sync == "adapter" else self.facts["bundle_bytes"][a.dtype]
        # "collective": every byte broadcast over gloo; "shared_memory": the same path with the bundle in a
        # shared segment (rollout.weight_transport)
        transport = {"collective": "broadcast", "shared_memory": "shared_memory"}.get(path)
        sync = None if transport is None else CollectiveWeightSync(a.bucket_mb, transport=transport)
        row = {
            "size": self.name,
            "kind": "push",
            "path": path,
            "engine": engine,
            "dtype": a.dtype,
            "probe": probe,
            "lora_sync": lora_sync if a.lora_rank else None,
        }
        row["bytes"] = nbytes
        seconds, wext, lext, stages = [], [], [], []
        try:
            for i in range(a.reps + 1):
                version += 1
                wsamp.reset()
                lsamp.reset()
                if sync is None:
                    result, bundle = push_weights(
                        self.ranks, [worker], [engine], version, a.dtype, a.timeout, probe or i == 0
                    )
                    del bundle  # the object store frees it
                else:
                    result, _ = sync.push(
                        self.ranks, [worker], [engine], version, a.dtype, a.timeout, probe or i == 0
                    )
                if result.lost:
                    raise RuntimeError(f"{engine} worker lost during push v{version}")
                if i == 0:
                    row["first_s"] = result.seconds
                    continue
                seconds.append(result.seconds)
                stages.append(result.stages)
                wext.append(wsamp.extra())
                lext.append(lsamp.extra())
        except Exception as err:  # reported in the row; the other rows go on
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"[{self.name}] {path} -> {engine} failed: {row['error']}", file=sys.stderr, flush=True)
            return row, version
        sec = statistics.median(seconds)
        row.update(
            seconds=sec,
            seconds_all=seconds,
            gb_per_s=nbytes / sec / 1e9,
            memcpy_fraction=nbytes / sec / 1e9 / self.memcpy,
            worker_peak_over_before_mib=max(wext) / MIB,
            learner0_peak_over_rest_mib=max(lext) / MIB,
            stages={k: statistics.median(s.get(k, 0.0) for s in stages) for k in stages[0]},
        )
        return row, version

    def run(self) -> None:
        a = self.args
        rows = self.rows
        try:
            self.start_learner()
            if not a.serial_engines:
                for engine in a.engines:
                    self.start_worker(engine)
            if not a.skip_step:
                rows += self.learner_step()
            version = 0
            for engine in a.engines:
                for sync in a.lora_sync:
                    if a.serial_engines or sync != "merged":
                        try:
                            self.start_worker(engine, sync)
                        except Exception as err:  # e.g. vLLM has no LoRA for the model: the row says so
                            why = f"{type(err).__name__}: {str(err)[-300:]}"
                            rows.append(self.failed_row(engine, "object_store", sync, why))
                            continue
                    for path in a.paths if sync == "merged" else ["object_store"]:
                        for probe in a.probe:
                            row, version = self.push_row(engine, path, version, probe == "on", sync)
                            rows.append(row)
                    if a.serial_engines or sync != "merged":
                        self.stop_worker(worker_key(engine, sync))
        finally:
            for s in self.samplers.values():
                s.close()
            stop_actors([*self.ranks, *self.workers.values()], self.ranks, a.timeout)
