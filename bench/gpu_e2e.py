"""GPU end to end: `cluster.train` on Ray, colocated and separate, on whatever one GPU is lent.

    python bench/gpu_e2e.py [--size qwen2-0.5b] [--steps 3] [--out DIR]        (make gpu-e2e)
    bash bench/gpu_e2e.sh --out $OUT                    (on a lent machine: installs the carried .gpu/)

What `bench/gpu_smoke.py` does not cover is what a user runs: `python -m cluster.train` on a local Ray
with `num_gpus`, placement groups, the roles as actors, the weight push between processes, the
checkpoints and `final/` written from GPU ranks. This script runs exactly that command, once per
placement, on the sentiment demo scaled up: the demo's tokenizer, prompts and reward classifier
(`demos.sentiment`, built here with a 1-step LM: its policy is not used) and a policy of `--size`
(`bench/scale_models.SIZES`: Qwen2-0.5B's shape by default, random weights, built on the spot):

- `colocated`: one learner rank's process holds the hf engine, the reference and the reward scorer
  too (`cluster.placement: colocated`); on a GPU the engine sleeps while the learner trains
  (`rollout.sleep_level` 1: weights offloaded to host memory);
- `separate`: the learner rank, the rollout worker, the reference and the reward scorer are actors of
  their own sharing the one device by fractional GPUs, weights pushed through the object store. A
  learner rank drives exactly one GPU (`learner.num_gpus_per_rank` must be 1), so Ray is told of two
  logical GPUs on the one device (`cluster.num_gpus` 2, `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`:
  every process sees the device as cuda:0): the learner takes 1, the rollout worker 0.5, the
  reference and the reward scorer 0.25 each;
- `separate-ipc`: the same, weights pushed on the collective path through CUDA IPC
  (`rollout.weight_transport: cuda_ipc`: the learner's CUDA buffer mapped by the rollout worker; on the
  CPU `auto`, which takes the /dev/shm segment there).

Each run's row: start-up (command start to the first step's start), per-step generation and
training seconds and tokens/s (means over the steps after the first), the weight push's seconds and
GB/s (the bundle's bytes at the engine's dtype over `time/weight_sync`), the engine-learner logprob
gap (`rollout/logprob_gap`, mean over the steps that measured it), peak GPU memory per role (sampled
from `nvidia-smi` every 0.2 s, by the Ray process title of each process on the device; absent on a
CPU), and whether the newest checkpoint and `final/` load back (the checkpoint's state is read and its
files' digests checked, `final/` loads in transformers and gives finite logits). The table is printed
and written to `--out` (`gpu_e2e.md`, `gpu_e2e.json`), with the device's own copy bandwidth (a
device-to-device copy of the bundle's size, `copy_gb_per_s`) to read the push's GB/s against. Exit
status 1 when a run or a load-back fails.

Without a GPU it runs on the CPU (gloo, float32, the tiny Qwen2 shape, short steps), which is how the
test suite keeps this script working (`tests/test_gpu_e2e.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from gpu_memory import GpuSampler  # noqa: E402 - bench/ is on the path from here on

GIB = 2**30
CONFIG = ROOT / "configs" / "sentiment_tiny.yaml"


@dataclass(frozen=True)
class Scale:
    """The run's sizes: a GPU run at the model's real shape, a CPU run small enough for the test suite."""

    size: str
    prompts_per_step: int
    chunk_size: int
    max_new_tokens: int
    micro_batch_size: int


GPU_SCALE = Scale("qwen2-0.5b", prompts_per_step=64, chunk_size=32, max_new_tokens=128, micro_batch_size=16)
CPU_SCALE = Scale("tiny-qwen2", prompts_per_step=4, chunk_size=4, max_new_tokens=8, micro_batch_size=4)

# The separate placement's logical GPUs (two on the one device; see the module docstring) and each
# role's share of them.
SEPARATE_LOGICAL_GPUS = 2
SEPARATE_GPUS = {
    "learner.num_gpus_per_rank": 1,
    "rollout.num_gpus_per_worker": 0.5,
    "reference.num_gpus": 0.25,
    "reward.num_gpus": 0.25,
}


@dataclass(frozen=True)
class RunKind:
    """One run of the script: its placement and how the weights reach the engine (`weights` on a GPU,
    `cpu_weights` on the CPU, where CUDA IPC cannot apply)."""

    name: str
    placement: str
    weight_sync: str = "object_store"
    transport: str = "auto"  # rollout.weight_transport (collective only)
    weights: str = "object store"
    cpu_weights: str = "object store"


RUNS = {
    r.name: r
    for r in (
        RunKind("colocated", "colocated", weights="in process", cpu_weights="in process"),
        RunKind("separate", "separate"),
        RunKind(
            "separate-ipc",
            "separate",
            weight_sync="collective",
            transport="cuda_ipc",
            weights="collective, CUDA IPC",
            cpu_weights="collective, shared memory (auto)",
        ),
    )
}


@dataclass
class Row:
    """One run's outcome: its measured numbers (`facts`) and the load-back checks."""

    run: str
    weights: str = ""
    status: str = "ok"
    facts: dict = field(default_factory=dict)
    gpu_peak_gib: dict = field(default_factory=dict)  # Ray process title -> peak GiB on the device
    checkpoint_loads: bool = False
    final_loads: bool = False
    note: str = ""


def overrides(run: RunKind, scale: Scale, assets, policy: str, steps: int, gpu: bool) -> list[str]:
    """The `--set` list of one run: the demo config pointed at the built assets, at `scale`."""
    placement = run.placement
    sets: dict[str, object] = {
        "model.policy_path": policy,
        "model.demo_assets": None,
        "data.prompts_path": assets.prompts,
        "data.prompts_per_step": scale.prompts_per_step,
        "eval.prompts_path": None,
        "reward.model_path": assets.reward,
        "run.steps": steps,
        "run.progress_bar": False,
        "run.sample_log_count": 0,
        "run.loggers": "[jsonl]",  # tensorboard and prometheus are not on a bare GPU image
        "cluster.dashboard": False,  # the device carries Ray without the dashboard's requirements
        "cluster.placement": placement,
        "rollout.chunk_size": scale.chunk_size,
        "rollout.sampling.max_new_tokens": scale.max_new_tokens,
        "learner.micro_batch_size": scale.micro_batch_size,
        "learner.torch_threads": 1,
        "rollout.weight_sync": run.weight_sync,
    }
    if run.weight_sync == "collective":  # CUDA IPC needs GPU weights; on the CPU auto takes shared memory
        sets["rollout.weight_transport"] = run.transport if gpu else "auto"
    if gpu:
        sets.update({"learner.dtype": "bfloat16", "rollout.dtype": "bfloat16"})
        if placement == "colocated":
            sets.update({"cluster.num_gpus": 1, "learner.num_gpus_per_rank": 1, "rollout.sleep_level": 1})
        else:
            sets.update({"cluster.num_gpus": SEPARATE_LOGICAL_GPUS, **SEPARATE_GPUS})
    else:
        sets.update({"rollout.num_cpus_per_worker": 0.5, "learner.num_cpus_per_rank": 1.0})
    return [f"{k}={'null' if v is None else v}" for k, v in sets.items()]


def build_policy(folder: Path, size: str, tokenizer_from: Path) -> dict:
    """`size`'s model (random weights, `scale_models.build_model`) with the demo's tokenizer in place of
    the tests' word-level one (same pad/bos/eos ids 0/1/2); returns the model's facts."""
    from scale_models import SIZES, build_model
    from transformers import AutoTokenizer

    marker = folder / "bench_scale.json"
    if marker.exists() and json.loads(marker.read_text()).get("spec") == SIZES[size]:
        facts = json.loads(marker.read_text())
    else:
        facts = build_model(str(folder), SIZES[size])
    tok = AutoTokenizer.from_pretrained(tokenizer_from, local_files_only=True)
    if len(tok) > facts["vocab_size"]:
        raise ValueError(f"{size}: vocabulary {facts['vocab_size']} < the demo tokenizer's {len(tok)}")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
        (folder / name).unlink(missing_ok=True)
    tok.save_pretrained(folder)
    return facts


def finite_mean(values: list) -> float:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else math.nan


def step_facts(rows: list[dict], bundle_bytes: int, startup_s: float) -> dict:
    """The table's numbers from a run's metrics rows (the first step is left out of the means where
    there are more: it includes warm-up)."""
    steady = rows[1:] or rows
    sync_s = finite_mean([r.get("time/weight_sync") for r in steady])
    return {
        "steps": len(rows),
        "startup_s": round(startup_s, 2),
        "generate_s": round(finite_mean([r.get("time/generate") for r in steady]), 3),
        "train_s": round(finite_mean([r.get("time/train") for r in steady]), 3),
        "step_s": round(finite_mean([r.get("time/step") for r in steady]), 3),
        "tokens_per_s": round(finite_mean([r.get("throughput/tokens_per_s") for r in steady]), 1),
        "weight_sync_s": round(sync_s, 4),
        "bundle_gb": round(bundle_bytes / 1e9, 3),
        "push_gb_per_s": round(bundle_bytes / 1e9 / sync_s, 2) if sync_s > 0 else math.nan,
        "logprob_gap": finite_mean([r.get("rollout/logprob_gap") for r in rows]),
        "reward_mean": round(finite_mean([r.get("rollout/reward_mean") for r in rows]), 4),
    }


def check_loads(run_dir: Path) -> tuple[bool, bool, str]:
    """(checkpoint loads, final/ loads, what failed). The newest checkpoint: its state read and checksum
    checked (`latest_checkpoint`), its fp32 master weights read (`learner.consolidated_checkpoint`) and
    equal, cast to `final/`'s dtype, to the weights `final/` holds (the last step wrote both). `final/`:
    loaded by transformers, finite logits on a few tokens."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from cluster.pipeline.checkpoint import LEARNER_DIR, latest_checkpoint
    from learner.consolidated_checkpoint import read_weights

    notes: list[str] = []
    ckpt_ok = final_ok = False
    try:
        model = AutoModelForCausalLM.from_pretrained(run_dir / "final", local_files_only=True)
        with torch.inference_mode():
            logits = model(torch.tensor([[1, 5, 6, 7]])).logits
        final_ok = bool(torch.isfinite(logits).all())
        if not final_ok:
            notes.append("final/: non-finite logits")
    except Exception as err:  # noqa: BLE001 - reported in the row
        notes.append(f"final/: {err!r}")
    try:
        master = read_weights(latest_checkpoint(run_dir) / LEARNER_DIR, "policy.")
        final = load_file(str(run_dir / "final" / "model.safetensors"))
        differ = [n for n, t in final.items() if n in master and not torch.equal(master[n].to(t.dtype), t)]
        shared = [n for n in final if n in master]
        ckpt_ok = bool(shared) and not differ
        if not ckpt_ok:
            notes.append(f"checkpoint: {len(shared)} tensors shared with final/, differing: {differ[:3]}")
    except Exception as err:  # noqa: BLE001 - reported in the row
        notes.append(f"checkpoint: {err!r}")
    return ckpt_ok, final_ok, "; ".join(notes)


def run_bounded(cmd: list[str], env: dict, out, timeout: float) -> int | None:
    """Run `cmd` in a process group of its own; its exit status, or None when it outlived `timeout` (then
    the whole group, its local Ray included, is sent SIGTERM, and SIGKILL 30 s later)."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return None


def run_one(run: RunKind, args, assets, policy: Path, facts: dict, gpu: bool) -> Row:
    row = Row(run.name, run.weights if gpu else run.cpu_weights)
    run_dir = Path(args.work) / f"run-{run.name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = overrides(run, args.scale, assets, str(policy), args.steps, gpu)
    cmd = [sys.executable, "-m", "cluster.train", str(CONFIG), "--run-dir", str(run_dir)]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    if gpu and run.placement == "separate":  # two logical GPUs, one device: every process keeps cuda:0
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    log = Path(args.work) / f"train-{run.name}.log"
    t0 = time.perf_counter()
    with GpuSampler() as sampler, log.open("w") as out:
        returncode = run_bounded(cmd, env, out, args.timeout)
    wall = time.perf_counter() - t0
    row.gpu_peak_gib = {k: round(v, 2) for k, v in sorted(sampler.peaks.items())}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "time/step" in r]
    if returncode != 0 or len(rows) < args.steps:
        row.status = "FAIL"
        why = "not done within --timeout" if returncode is None else f"exit {returncode}"
        row.note = f"{why}, {len(rows)} steps; last lines of {log}:\n" + "".join(
            log.read_text().splitlines(True)[-15:]
        )
        return row
    # start-up: what the command's wall time holds beyond the steps and the end (final/ and the last
    # checkpoint are written after the last step: `time/step` does not hold them)
    startup = wall - sum(r["time/step"] for r in rows)
    row.facts = step_facts(rows, facts["bundle_bytes"][args.engine_dtype], startup)
    row.checkpoint_loads, row.final_loads, row.note = check_loads(run_dir)
    if not (row.checkpoint_loads and row.final_loads):
        row.status = "FAIL"
    return row


COLUMNS = [
    ("run", lambda r: r.run),
    ("weights", lambda r: r.weights),
    ("status", lambda r: r.status),
    ("start-up + end (s)", lambda r: r.facts.get("startup_s")),
    ("generate (s/step)", lambda r: r.facts.get("generate_s")),
    ("train (s/step)", lambda r: r.facts.get("train_s")),
    ("tokens/s", lambda r: r.facts.get("tokens_per_s")),
    ("weight push (s)", lambda r: r.facts.get("weight_sync_s")),
    ("push GB/s", lambda r: r.facts.get("push_gb_per_s")),
    ("logprob gap", lambda r: r.facts.get("logprob_gap")),
    ("peak GPU GiB by role", lambda r: ", ".join(f"{k} {v}" for k, v in r.gpu_peak_gib.items()) or "n/a"),
    (
        "checkpoint / final/ load",
        lambda r: f"{'yes' if r.checkpoint_loads else 'no'} / {'yes' if r.final_loads else 'no'}",
    ),
]


def copy_gb_per_s(nbytes: int, reps: int = 5) -> float:
    """GB/s of a device-to-device copy of `nbytes` on the current GPU (one warm-up, then the mean of
    `reps`; bytes copied over seconds, each byte read once and written once)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / 1e9 / seconds


def table(rows: list[Row]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.4g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(c for c, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(f(r)) for _, f in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def report_text(
    device: str, size: str, facts: dict, bundle: int, copy: float | None, versions: dict, rows
) -> str:
    header = f"device: {device}; model: {size} ({facts['params'] / 1e6:.0f}M parameters, bundle {bundle / 1e9:.3f} GB"
    header += f"; device copy {copy} GB/s); " if copy else "); "
    header += ", ".join(f"{k} {v}" for k, v in versions.items())
    return header + "\n\n" + table(rows)


def main(argv: list[str] | None = None) -> int:
    import torch

    gpu = torch.cuda.is_available()
    base = GPU_SCALE if gpu else CPU_SCALE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default=base.size, help="a bench/scale_models.SIZES name")
    ap.add_argument("--steps", type=int, default=3 if gpu else 2)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"some of {list(RUNS)}")
    ap.add_argument(
        "--out", default=None, help="folder for gpu_e2e.md / gpu_e2e.json (written after each run)"
    )
    ap.add_argument("--work", default=None, help="folder for the assets and runs (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=240.0 if gpu else 600.0, help="seconds per run")
    args = ap.parse_args(argv)
    args.scale = Scale(
        args.size, base.prompts_per_step, base.chunk_size, base.max_new_tokens, base.micro_batch_size
    )
    args.engine_dtype = "bfloat16" if gpu else "float32"
    runs = [p for p in args.runs.split(",") if p]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        ap.error(f"--runs: {unknown} not in {list(RUNS)}")
    versions = {"torch": torch.__version__}
    for name in ("ray", "deepspeed", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "missing"
    device = torch.cuda.get_device_name(0) if gpu else "cpu"
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        args.work = args.work or tmp
        Path(args.work).mkdir(parents=True, exist_ok=True)
        from demos.sentiment import ensure_assets

        assets = ensure_assets(Path(args.work) / "sentiment", lm_steps=1, clf_steps=50, quiet=True)
        policy = Path(args.work) / args.size
        facts = build_policy(policy, args.size, assets.policy)
        bundle = facts["bundle_bytes"][args.engine_dtype]
        copy = round(copy_gb_per_s(bundle), 1) if gpu else None
        for name in runs:  # the report is rewritten after each run: a call cut short keeps the runs done
            rows.append(run_one(RUNS[name], args, assets, policy, facts, gpu))
            text = report_text(device, args.size, facts, bundle, copy, versions, rows)
            if args.out:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "gpu_e2e.md").write_text(text + "\n")
                report = {
                    "device": device,
                    "versions": versions,
                    "model": args.size,
                    "params": facts["params"],
                }
                report["copy_gb_per_s"] = copy
                report["scale"] = asdict(args.scale)
                report["rows"] = [asdict(r) for r in rows]
                (out / "gpu_e2e.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(text, flush=True)
    for r in rows:
        if r.note:
            print(f"{r.run}: {r.note}", flush=True)
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
