"""A warm Tinker service against a cold `cluster.train` start, on the same model (issue #60, item 6).

    python bench/bench_serve.py [--models sentiment-tiny,qwen2-75m] [--reps 3] [--out DIR]   (make bench-serve)

Per model (`sentiment-tiny`: the sentiment demo's policy, built by `make assets`; any other name: a
`bench/scale_models.SIZES` shape with random weights and the demo's tokenizer, built on the spot):

- cold: `python -m cluster.train configs/sentiment_tiny.yaml` pointed at the model, one step, `--reps`
  times: `start-up` is command start to the first step's start (the first metrics row's arrival, polled
  every 0.1 s, less its `time/step`), `first step` is command start to that row;
- service: `python -m cluster.serve` once for all models, command start to its `serving <url>` line;
- warm, `--reps` times, each a new `tinker.ServiceClient` (the real SDK in `.venv-tinker`,
  bench/serve_client.py): `create_lora_training_client` → its first `forward_backward` done, and
  (a second client) `create_lora_training_client` → its first `sample` done, through
  `save_weights_and_get_sampling_client`; the model's creation alone is shown too. Twice per model: the
  service serves it under its name with no warm pool (`warm: 0`: each tenant's actor starts and loads
  the model on `create_model`) and as `<name>@pool` with `warm: 2` (each tenant takes a pool actor that
  has loaded the model already, `cluster.serve.pool`); the bench waits for the service's `warm pool
  ...: an actor has loaded its base model` lines (every pool before the first timing, a rep's
  replacements after it), so no rep takes an actor still loading; within a pooled rep the first
  tenant's replacement loads while the rep goes on, as it would in use;
- throughput: `forward_backward` (cross_entropy, `--batch` x `--length` random tokens, `--calls` calls
  sent at once after one warm-up call) through the service, against the same calls on the same tenant
  model (`cluster.serve.tenant.TenantModel`, same LoRA, one torch thread as the service's tenants) made
  directly in this process; both sides in one run, `--reps` times each.

Every time is a mean ± sample standard deviation over the repetitions. The table is printed and written
to `--out` (`bench_serve.md`, `bench_serve.json`) with the machine and the date. Timings on a machine
others are using are indicative only: check that nothing else runs before trusting them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

TINKER_PY = ROOT / ".venv-tinker" / "bin" / "python"
CLIENT = ROOT / "bench" / "serve_client.py"
TRAIN_CONFIG = ROOT / "configs" / "sentiment_tiny.yaml"
DEMO = "sentiment-tiny"
KEY = "tml-bench-serve"
LORA_RANK = 8  # bench/serve_client.py's rank
LORA_ALPHA = 32.0
POOLED, POOL = "@pool", 2  # each model is served again as <name>@pool with a warm pool of 2 actors


class PoolLog:
    """The service's `warm pool <model>: an actor has loaded its base model` lines (`cluster.serve.pool`),
    counted per model as the bench reads the service's output."""

    def __init__(self, service: subprocess.Popen) -> None:
        self.service = service
        self.loaded: dict[str, int] = {}

    def wait(self, model: str, total: int) -> None:
        """Read the service's output until `model`'s pool actors have loaded `total` times in all."""
        seen = []
        while self.loaded.get(model, 0) < total:
            line = self.service.stdout.readline()
            if not line:
                raise RuntimeError("cluster.serve ended while its warm pool loaded:\n" + "".join(seen[-20:]))
            seen.append(line)
            if line.startswith("warm pool "):
                if "has loaded" not in line:
                    raise RuntimeError(f"a warm pool actor failed: {line}")
                name = line[len("warm pool ") :].split(":")[0]
                self.loaded[name] = self.loaded.get(name, 0) + 1


@dataclass
class Spread:
    """Mean and sample standard deviation of repeated measurements (std 0 for one)."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(
            statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)
        )

    def __str__(self) -> str:
        return f"{self.mean:.2f} ± {self.std:.2f}"


@dataclass
class ModelRow:
    name: str
    params: int
    cold_startup_s: Spread | None = None
    cold_first_step_s: Spread | None = None
    create_s: Spread | None = None
    first_fb_s: Spread | None = None
    first_sample_s: Spread | None = None
    pool_create_s: Spread | None = None  # the same three, each tenant from the warm pool
    pool_first_fb_s: Spread | None = None
    pool_first_sample_s: Spread | None = None
    service_tokens_s: Spread | None = None
    direct_tokens_s: Spread | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    params: int
    vocab: int


def prepare_models(names: list[str], work: Path):
    """The demo's assets (prompts, reward model, tokenizer) and each model's folder."""
    from gpu_e2e import build_policy
    from safetensors import safe_open
    from scale_models import SIZES
    from transformers import AutoConfig

    from demos.sentiment import ensure_assets

    assets = ensure_assets(ROOT / "assets" / "sentiment_tiny", quiet=True)
    models = []
    for name in names:
        if name == DEMO:
            path = Path(assets.policy)
        elif name in SIZES:
            path = work / name
            build_policy(path, name, Path(assets.policy))
        else:
            raise SystemExit(f"--models: {name!r} is neither {DEMO!r} nor one of {sorted(SIZES)}")
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - a safetensors handle, not a dict
        models.append(Model(name, path, params, cfg.get_text_config().vocab_size))
    return assets, models


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process's group (its local Ray too), SIGKILL 30 s later."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def cold_train(model: Model, assets, work: Path, rep: int, timeout: float) -> tuple[float, float]:
    """(start-up s, first step s) of one `cluster.train` run of one step on `model`."""
    run_dir = work / f"train-{model.name}-{rep}"
    sets = {
        "model.policy_path": str(model.path),
        "model.demo_assets": "null",
        "data.prompts_path": str(assets.prompts),
        "reward.model_path": str(assets.reward),
        "eval.prompts_path": "null",
        "run.steps": 1,
        "run.progress_bar": "false",
        "run.sample_log_count": 0,
        "run.loggers": "[jsonl]",
        "cluster.dashboard": "false",
    }
    cmd = [sys.executable, "-m", "cluster.train", str(TRAIN_CONFIG), "--run-dir", str(run_dir)]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    log = (work / f"train-{model.name}-{rep}.log").open("w")
    metrics = run_dir / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        while True:
            elapsed = time.perf_counter() - t0
            rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
            rows = [r for r in rows if "time/step" in r]
            if rows:
                return elapsed - rows[0]["time/step"], elapsed
            if proc.poll() is not None or elapsed > timeout:
                tail = "".join(Path(log.name).read_text().splitlines(True)[-15:])
                raise RuntimeError(
                    f"cluster.train on {model.name} made no step (exit {proc.poll()}):\n{tail}"
                )
            time.sleep(0.1)
    finally:
        kill_group(proc)
        log.close()


def start_service(models: list[Model], work: Path) -> tuple[subprocess.Popen, str, float]:
    cfg = work / "serve.yaml"
    cfg.write_text(
        json.dumps(
            {
                "port": 0,
                "api_keys": [KEY],
                "base_models": [{"name": m.name, "path": str(m.path)} for m in models]
                + [{"name": m.name + POOLED, "path": str(m.path), "warm": POOL} for m in models],
                "lora_alpha": LORA_ALPHA,
                "torch_threads": 1,
                "tenant_cpus": 0.25,  # logical: a rep's two tenants and its sampler fit beside the next rep's
            }
        )
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.serve", str(cfg)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("serving "):
            return proc, line.split()[1], time.perf_counter() - t0
    proc.wait()
    raise RuntimeError("cluster.serve ended before serving:\n" + "".join(seen))


def sdk(*args: str, timeout: float) -> dict:
    out = subprocess.run(
        [str(TINKER_PY), str(CLIENT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TINKER_TELEMETRY": "0"},
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(
            f"bench/serve_client.py {args[0]} failed (exit status {out.returncode}):\n"
            f"{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def batch(model: Model, size: int, length: int, seed: int) -> list[list[int]]:
    """`size` rows of `length` + 1 random token ids (inputs are a row's first `length`, targets its last)."""
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, model.vocab) for _ in range(length)] for _ in range(size)]


def direct_tokens_s(model: Model, rows: list[list[int]], calls: int, reps: int) -> list[float]:
    """tokens/s of `calls` forward_backward calls on a TenantModel in this process (after one warm-up)."""
    import numpy as np

    from cluster.serve.tenant import TenantModel
    from cluster.serve.wire import WireDatum
    from learner.config_blocks import LoRAConfig

    lora = LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA, target_modules="all-linear")
    tenant = TenantModel(str(model.path), lora, 0, 1)
    data = [
        WireDatum(
            np.asarray(r[:-1], dtype=np.int64),
            {"target_tokens": np.asarray(r[1:], dtype=np.int64), "weights": np.ones(len(r) - 1, np.float32)},
        )
        for r in rows
    ]
    tokens = sum(len(r) - 1 for r in rows) * calls
    tenant.forward_backward(data, "cross_entropy", {}, False)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            tenant.forward_backward(data, "cross_entropy", {}, False)
        out.append(tokens / (time.perf_counter() - t0))
    return out


def table(rows: list[ModelRow], service_s: float) -> str:
    def cell(x):
        return "n/a" if x is None else str(x)

    head = (
        "| model | params | cold cluster.train: start-up (s) | cold: first step done (s) "
        "| warm: create_model (s) | warm: create → first forward_backward (s) | warm: create → first sample (s) "
        "| warm pool: create_model (s) | pool: create → first forward_backward (s) | pool: create → first sample (s) "
        "| forward_backward tokens/s: service | direct | ratio |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        ratio = (
            f"{r.service_tokens_s.mean / r.direct_tokens_s.mean:.2f}"
            if r.service_tokens_s and r.direct_tokens_s
            else "n/a"
        )
        tok = [
            "n/a" if s is None else f"{s.mean:.0f} ± {s.std:.0f}"
            for s in (r.service_tokens_s, r.direct_tokens_s)
        ]
        lines.append(
            f"| {r.name} | {r.params / 1e6:.2f}M | {cell(r.cold_startup_s)} | {cell(r.cold_first_step_s)} "
            f"| {cell(r.create_s)} | {cell(r.first_fb_s)} | {cell(r.first_sample_s)} "
            f"| {cell(r.pool_create_s)} | {cell(r.pool_first_fb_s)} | {cell(r.pool_first_sample_s)} "
            f"| {tok[0]} | {tok[1]} | {ratio} |"
        )
    lines.append(f"\nService start-up (cold, once, all models): {service_s:.2f} s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from machine import describe

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models", default=f"{DEMO},qwen2-75m", help=f"{DEMO} and/or bench/scale_models.SIZES names"
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every measurement")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--calls", type=int, default=8, help="forward_backward calls per throughput repetition")
    ap.add_argument("--out", default="runs/bench-serve")
    ap.add_argument(
        "--work", default=None, help="folder for built models and runs (default: a temporary one)"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for one run or one SDK call")
    ap.add_argument("--label", default="", help="a note printed with the table (e.g. 'busy machine')")
    args = ap.parse_args(argv)
    if not TINKER_PY.exists():
        raise SystemExit(f"{TINKER_PY} is missing: `make test-tinker` makes .venv-tinker (tinker 0.38.0)")
    names = [n for n in args.models.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        assets, models = prepare_models(names, work)
        rows = [ModelRow(m.name, m.params) for m in models]
        for m, row in zip(models, rows, strict=True):  # cold runs first, alone on the machine
            runs = [cold_train(m, assets, work, i, args.timeout) for i in range(args.reps)]
            row.cold_startup_s = Spread.of([s for s, _ in runs])
            row.cold_first_step_s = Spread.of([f for _, f in runs])
        proc, url, service_s = start_service(models, work)
        try:
            pool_log = PoolLog(proc)
            for m in models:  # every pool loaded before anything is timed
                pool_log.wait(m.name + POOLED, POOL)
            for m, row in zip(models, rows, strict=True):
                prompt = json.dumps(batch(m, 1, 8, seed=0)[0])
                warm = [sdk("warm", url, KEY, m.name, prompt, timeout=args.timeout) for _ in range(args.reps)]
                row.create_s = Spread.of([w["create_s"] for w in warm])
                row.first_fb_s = Spread.of([w["first_fb_s"] for w in warm])
                row.first_sample_s = Spread.of([w["first_sample_s"] for w in warm])
                pooled = []
                for i in range(args.reps):  # a rep takes both pool actors; their replacements load after it
                    pooled.append(sdk("warm", url, KEY, m.name + POOLED, prompt, timeout=args.timeout))
                    pool_log.wait(m.name + POOLED, POOL * (i + 2))  # loaded before the next timing
                row.pool_create_s = Spread.of([w["create_s"] for w in pooled])
                row.pool_first_fb_s = Spread.of([w["first_fb_s"] for w in pooled])
                row.pool_first_sample_s = Spread.of([w["first_sample_s"] for w in pooled])
                rows_ = batch(m, args.batch, args.length, seed=1)
                tokens = args.batch * args.length * args.calls
                through = [
                    sdk(
                        "throughput",
                        url,
                        KEY,
                        m.name,
                        json.dumps(rows_),
                        str(args.calls),
                        timeout=args.timeout,
                    )
                    for _ in range(args.reps)
                ]
                row.service_tokens_s = Spread.of([tokens / t["fb_s"] for t in through])
                row.direct_tokens_s = Spread.of(direct_tokens_s(m, rows_, args.calls, args.reps))
        finally:
            kill_group(proc)
    machine = describe()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"bench_serve, {date}, {machine['cores']} cores ({machine['cpu']}), {machine['ram_gib']:.0f} GiB"
        + (f", {args.label}" if args.label else "")
        + f"; {args.reps} repetition(s); throughput: {args.batch} x {args.length} tokens x {args.calls} calls\n\n"
        + table(rows, service_s)
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve.md").write_text(text + "\n")
    report = {
        "date": date,
        "machine": machine,
        "label": args.label,
        "args": vars(args),
        "service_s": service_s,
    }
    report["rows"] = [asdict(r) for r in rows]
    (out / "bench_serve.json").write_text(json.dumps(report, indent=1) + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
