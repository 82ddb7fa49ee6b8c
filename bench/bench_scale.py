"""Learner memory and the weight push at model scale: Qwen2-0.5B's shape, GPT-2 124M and a Qwen2-shaped
model ~6.6x smaller than 0.5B, in one run (one process, one local Ray).

    .venv-vllm/bin/python bench/bench_scale.py [--sizes qwen2-75m gpt2-124m qwen2-0.5b] [--dtype bfloat16]
        [--reps 3] [--smoke] [--serial-engines] [--out runs/bench-scale/results.json]

Models are built from configs with random weights (float32; the tests' word-level tokenizer and its
special ids, tests/tiny_models.py: nothing is downloaded) into `--models` (runs/bench-scale/models), once; reruns
reuse them. A build runs in a Ray task of its own, so its memory never shows in the driver.

Per size, with fresh actors (all killed before the next size, so memory does not add up):
  learner  2 `LearnerRank` actors (ZeRO-3, float32, gloo on CPU) run one `train_step` on `--samples`
           trajectories of `--prompt-tokens` + `--response-tokens` (half per rank). RSS at rest (before
           the step) and the step's peak over it, per rank.
  push     learner rank 0 -> one `RolloutWorker` at a time (hf, then vLLM with its CPU defaults; rollout
           dtype `--dtype`), over the object store (`push_weights`) and the collective broadcast
           (`CollectiveWeightSync`). One warm-up push (which also forms the broadcast group), then
           `--reps` pushes: seconds is the median `SyncResult.seconds` (export with the probe and digest
           on rank 0 -> transfer -> load -> acknowledged and verified); bytes are the bundle at the rollout
           dtype (unique tensors: tied weights once); GB/s = bytes / seconds; memcpy = that over this
           machine's copy bandwidth at the actors' thread count. Peak RSS over the RSS before the push of
           the worker and of learner rank 0: the largest over the timed pushes.
  driver   this process's peak RSS over the size (and over its RSS when the size started), the peak PSS
           of the whole process tree (driver + Ray + actors), and the share of the CPUs other processes
           used meanwhile (on a shared machine, timings with a large share are unreliable).
Every RSS is sampled from the driver every 5 ms (psutil). The memory-copy bandwidth is measured before
each size (after the idle wait; the machine is shared, so it moves) in a Ray task of its own: torch
`copy_` between two `--memcpy-mib` buffers, median of 5, with the actors' thread count and with all
cores. Prints markdown tables per size and writes every row as JSON to `--out` (after each size).
Nothing is asserted.

`--smoke` builds tiny models (~1.7M parameters) and measures less; `--serial-engines` starts each
rollout worker only for its own rows (for a machine where the learner and both engines do not fit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MIB = 2**20

# Pinned before torch (imported with the learner's classes) reads them; the actors get them through
# the job's runtime env, and set their torch threads from the configs.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

QWEN2_05B = {  # Qwen/Qwen2-0.5B's config.json (random weights here)
    "family": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": 131072,
    "max_window_layers": 24,
}
SIZES: dict[str, dict] = {
    "qwen2-75m": {  # Qwen2-0.5B's head size (64) and MLP ratio; 6.6x fewer parameters
        "family": "qwen2",
        "hidden_size": 512,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 2752,
        "vocab_size": 32768,
        "max_position_embeddings": 4096,
    },
    "gpt2-124m": {"family": "gpt2"},  # transformers' GPT2Config defaults are gpt2's
    "qwen2-0.5b": QWEN2_05B,
    "tiny-qwen2": {
        "family": "qwen2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 704,
        "vocab_size": 8192,
        "max_position_embeddings": 4096,
    },
    "tiny-gpt2": {"family": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 2, "vocab_size": 8192},
}
FULL = ["qwen2-75m", "gpt2-124m", "qwen2-0.5b"]
SMOKE = ["tiny-qwen2"]
ENGINES = ("hf", "vllm")
PATHS = ("object_store", "collective")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FULL_DEFAULTS = {"reps": 3, "samples": 8, "prompt_tokens": 64, "response_tokens": 192, "memcpy_mib": 1024}
SMOKE_DEFAULTS = {"reps": 2, "samples": 4, "prompt_tokens": 16, "response_tokens": 48, "memcpy_mib": 256}


def build_model(folder: str, spec: dict) -> dict:
    """Build `spec`'s model (float32, seed 0) with the tests' word-level tokenizer into `folder`; returns
    its facts (parameters, bundle bytes per dtype), also written to `folder`/bench_scale.json last, so a
    folder with that file is complete. Runs in a Ray task (it holds the whole model while it builds)."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tokenizer

    fields = {k: v for k, v in spec.items() if k != "family"}
    tokenizer = build_tokenizer()
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # the tokenizer's
    if spec["family"] == "gpt2":
        cfg = GPT2Config(activation_function="gelu_pytorch_tanh", **fields, **ids)
        cls = GPT2LMHeadModel
    else:
        cfg = Qwen2Config(tie_word_embeddings=True, **fields, **ids)
        cls = Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).float()
    tmp = Path(folder).with_name(Path(folder).name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights are one tensor
    facts = {
        "spec": spec,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": cfg.vocab_size,
        "bundle_bytes": {
            dt: sum(
                t.numel() * (size if t.is_floating_point() else t.element_size()) for t in unique.values()
            )
            for dt, size in DTYPE_BYTES.items()
        },
    }
    (tmp / "bench_scale.json").write_text(json.dumps(facts))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return facts


def cached_model(models: Path, name: str, timeout: float) -> tuple[str, dict]:
    """(folder, facts) of size `name`, built first unless `models`/`name` holds it with the same spec."""
    import ray

    folder = models / name
    marker = folder / "bench_scale.json"
    if marker.exists():
        facts = json.loads(marker.read_text())
        if facts.get("spec") == SIZES[name]:
            return str(folder), facts
    print(f"building {name} into {folder} ...", file=sys.stderr, flush=True)
    models.mkdir(parents=True, exist_ok=True)
    task = ray.remote(num_cpus=1, max_calls=1)(build_model)
    return str(folder), ray.get(task.remote(str(folder), SIZES[name]), timeout=timeout)


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
        from machine import PeakRSS

        from learner.config import LearnerConfig
        from learner.rank import LearnerRank

        a = self.args
        cfg = LearnerConfig(
            zero_stage=3,
            dtype="float32",
            backend="gloo",
            torch_threads=a.threads,
            ppo_epochs=1,
            micro_batch_size=a.micro_batch,
            dist_timeout_s=a.timeout,
        )
        t0 = time.perf_counter()
        actor = ray.remote(LearnerRank).options(num_cpus=1)
        self.ranks = [actor.remote(r, 2, self.policy, cfg) for r in range(2)]
        host, port = ray.get(self.ranks[0].node_address.remote(), timeout=a.timeout)
        ray.get([r.setup.remote(host, port) for r in self.ranks], timeout=a.timeout)
        self.start_s["learner"] = time.perf_counter() - t0
        for r, rank in enumerate(self.ranks):
            self.samplers[f"rank{r}"] = PeakRSS(pid_of(rank, a.timeout))

    def start_worker(self, engine: str) -> None:
        import ray
        from machine import PeakRSS

        from rollout_workers.config import RolloutConfig, VLLMConfig
        from rollout_workers.worker import RolloutWorker

        a = self.args
        # vLLM's KV cache on CPU is 0.25 GiB by default: max_model_len as the cluster sets it (prompt +
        # response), not the model's own limit (131072 positions for Qwen2-0.5B would not fit).
        vllm = VLLMConfig(max_model_len=a.prompt_tokens + a.response_tokens)
        cfg = RolloutConfig(engine=engine, dtype=a.dtype, torch_threads=a.threads, vllm=vllm)
        t0 = time.perf_counter()
        worker = ray.remote(RolloutWorker).options(num_cpus=0.5).remote(self.policy, cfg)
        ray.get(worker.ping.remote(), timeout=a.timeout)
        self.start_s[engine] = time.perf_counter() - t0
        self.workers[engine] = worker
        self.samplers[engine] = PeakRSS(pid_of(worker, a.timeout))

    def stop_worker(self, engine: str) -> None:
        self.samplers.pop(engine).close()
        stop_actors([self.workers.pop(engine)], [], self.args.timeout)

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

    def push_row(self, engine: str, path: str, version: int) -> tuple[dict, int]:
        """One (engine, path) row: a warm-up push and `reps` timed ones; returns it and the last version."""
        from cluster.weights.collective import CollectiveWeightSync
        from cluster.weights.push import push_weights

        a = self.args
        worker, wsamp, lsamp = self.workers[engine], self.samplers[engine], self.samplers["rank0"]
        nbytes = self.facts["bundle_bytes"][a.dtype]
        sync = CollectiveWeightSync(a.bucket_mb) if path == "collective" else None
        row = {"size": self.name, "kind": "push", "path": path, "engine": engine, "dtype": a.dtype}
        row["bytes"] = nbytes
        seconds, wext, lext, stages = [], [], [], []
        try:
            for i in range(a.reps + 1):
                version += 1
                wsamp.reset()
                lsamp.reset()
                if sync is None:
                    result, bundle = push_weights(self.ranks, [worker], [engine], version, a.dtype, a.timeout)
                    del bundle  # the object store frees it
                else:
                    result, _ = sync.push(self.ranks, [worker], [engine], version, a.dtype, a.timeout)
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
                if a.serial_engines:
                    self.start_worker(engine)
                for path in a.paths:
                    row, version = self.push_row(engine, path, version)
                    rows.append(row)
                if a.serial_engines:
                    self.stop_worker(engine)
        finally:
            for s in self.samplers.values():
                s.close()
            stop_actors([*self.ranks, *self.workers.values()], self.ranks, a.timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=None, help=f"default {FULL} ({SMOKE} with --smoke)"
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny models, fewer/smaller measurements (about a minute)"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_BYTES), help="rollout dtype")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--reps", type=int, default=None, help="timed pushes per row (after one warm-up)")
    ap.add_argument("--samples", type=int, default=None, help="trajectories in the learner step (both ranks)")
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--response-tokens", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=2, help="learner.micro_batch_size")
    ap.add_argument(
        "--skip-step",
        action="store_true",
        help="no learner step (the pushes only: where the step does not fit)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch (and OMP) threads per actor")
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="collective broadcast bucket")
    ap.add_argument("--memcpy-mib", type=int, default=None, help="buffer of the memory-copy measurement")
    ap.add_argument(
        "--serial-engines", action="store_true", help="start each rollout worker only for its rows"
    )
    ap.add_argument(
        "--wait-idle", type=float, default=None, help="max seconds to wait for an idle machine per size"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for any one Ray call")
    ap.add_argument("--models", type=Path, default=ROOT / "runs" / "bench-scale" / "models")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-scale" / "results.json")
    args = ap.parse_args()
    for k, v in (SMOKE_DEFAULTS if args.smoke else FULL_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.sizes = args.sizes or (SMOKE if args.smoke else FULL)
    if args.wait_idle is None:
        args.wait_idle = 0.0 if args.smoke else 120.0

    threads = str(args.threads)
    for var in THREAD_VARS:
        os.environ[var] = threads
    env = dict.fromkeys(THREAD_VARS, threads)
    env.update(
        TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1"
    )

    import machine
    import ray
    import torch

    # The actors' classes (torch, transformers, DeepSpeed; not vLLM) imported before the first size,
    # so each size's driver growth is its own, not the imports'.
    import cluster.weights.push  # noqa: F401
    import learner.rank  # noqa: F401
    import rollout_workers.worker  # noqa: F401

    torch.set_num_threads(args.threads)
    ray.init(
        address="local",
        num_cpus=8,  # logical: 2 learner ranks (1 each), 2 workers (0.5 each), a task; on any core count
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": env},
    )
    try:
        desc = machine.describe()
        copy = ray.remote(num_cpus=1, max_calls=1)(machine.memcpy_gbps)
        head = {
            **desc,
            "torch_threads_per_actor": args.threads,
            "omp_num_threads": threads,
            "ray": ray.__version__,
            "torch": torch.__version__,
        }
        print(
            f"## bench-scale: {desc['cpu']}, {desc['cores']} cores ({desc['physical_cores']} physical), "
            f"{desc['ram_gib']:.1f} GiB RAM ({desc['available_gib']:.1f} available at start); torch {torch.__version__}, "
            f"ray {ray.__version__}\n"
        )
        print(
            f"torch/OMP threads per actor: {args.threads}. Memory-copy bandwidth per size, just before it (the "
            f"machine is shared: it moves), torch copy_ between two {args.memcpy_mib} MiB buffers, median of 5, "
            f"bytes copied per second; 'of memcpy' is against the {args.threads}-thread figure (as each actor). "
            f"Learner: 2 ranks ZeRO-3 float32 gloo, micro-batch {args.micro_batch}, one step on {args.samples} x "
            f"({args.prompt_tokens} + {args.response_tokens}) tokens. Push: median of {args.reps} after 1 warm-up, "
            f"rollout dtype {args.dtype}, collective bucket {args.bucket_mb:g} MiB; "
            + ("engines one at a time." if args.serial_engines else "both engines' workers alive throughout.")
        )
        rows: list[dict] = []
        all_facts = {}
        for name in args.sizes:
            policy, facts = cached_model(args.models, name, args.timeout)
            all_facts[name] = facts
            machine.wait_for_idle(args.wait_idle)
            counts = sorted({args.threads, desc["cores"]})
            memcpy = {t: ray.get(copy.remote(args.memcpy_mib * MIB, t), timeout=600) for t in counts}
            rows += [
                {"size": name, "kind": "memcpy", "threads": t, "buffer_mib": args.memcpy_mib, "gb_per_s": g}
                for t, g in memcpy.items()
            ]
            driver = machine.PeakRSS()
            tree = machine.TreeSampler(os.getpid(), 0.5)
            tree.start()
            t0 = time.perf_counter()
            size = Size(name, policy, facts, args, memcpy[args.threads])
            try:
                size.run()
            except Exception as err:  # the size failed; the next one still runs
                error = f"{type(err).__name__}: {str(err)[:500]}"
                size.rows.append({"size": name, "kind": "error", "error": error})
            rows += size.rows
            seen = tree.stop()
            rows.append(
                {
                    "size": name,
                    "kind": "driver",
                    "peak_rss_mib": max(driver.peak, driver.rss()) / MIB,
                    "peak_over_start_mib": driver.extra() / MIB,
                    "tree_peak_pss_mib": seen["peak_pss_mb"],
                    "foreign_cpu_frac": seen["foreign_cpu_frac"],
                    "start_s": size.start_s,
                    "wall_s": time.perf_counter() - t0,
                }
            )
            driver.close()
            from scale_report import print_size

            print_size(name, facts, rows, args)
            args.out.parent.mkdir(parents=True, exist_ok=True)  # after every size: a later failure keeps it
            settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
            payload = {"machine": head, "settings": settings, "models": all_facts, "rows": rows}
            args.out.write_text(json.dumps(payload, indent=1))
        print(f"\nrows written to {args.out}")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
