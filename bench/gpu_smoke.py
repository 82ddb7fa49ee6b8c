"""GPU smoke: the roles' accelerator code in one process, without Ray, on whatever one GPU is lent.

    python bench/gpu_smoke.py [--size qwen2-0.5b] [--out DIR]          (make gpu-smoke)

What a lent machine has (PyTorch with CUDA, transformers, PEFT) plus what fits in one call (DeepSpeed's
source distribution and the small wheels it needs, `bench/gpu_smoke.sh` installs them) is enough to
run, on a model of `--size` (`bench/scale_models.SIZES`: Qwen2-0.5B's shape by default, random
weights, built on the spot):

1. generate: the hf rollout engine (`rollout_workers.hf_engine.HFEngine`, bf16) samples `--prompts` x
   `--n` responses of `--max-new` tokens; tokens/s and peak GPU memory;
2. behaviour logprobs: the sampled tokens' logprobs are compared with a teacher-forced float32 forward
   of the same weights (the gap a learner sees on its first epoch) and with the engine's own
   teacher-forced bf16 forward (the KV-cache path against the full forward);
3. sleep / wake: GPU memory allocated before, asleep and awake again, and the same seed sampling the
   same tokens after waking;
4. learner: one DeepSpeed ZeRO rank (`learner.rank.LearnerRank`, bf16, NCCL on a GPU) trains
   `--steps` PPO steps on those samples (the float32 teacher as the reference), packed into
   padding-free rows through SDPA (and flash-attention's varlen kernel when `flash_attn` imports);
   tokens/s, peak GPU memory and the first step's importance ratio; with `--lora-rank R` it trains
   LoRA adapters (`learner.lora`, alpha 2R, all-linear) and exports the merged weights;
5. weights: the learner's export (bf16) is loaded into the engine, whose digest must equal the
   bundle's, and the engine's probe logprobs are compared with the learner's;
6. adapter weights (with `--lora-rank`): the learner exports the adapter alone
   (`rollout.lora_sync='adapter'`), a second engine on the base weights applies it; its bytes against
   the merged bundle's, its adapter digest, and its probe logprobs against the learner's and the
   merged engine's.

What it does not cover: Ray, more than one learner rank (one GPU cannot hold an NCCL group of two),
vLLM, and the collective weight push over NCCL. Every section prints one table row; `--out` also
writes them to `gpu_smoke.json`. Exit status 1 when a check fails, 0 otherwise (a section skipped for
a missing package says so in its row). On a machine without a GPU it runs on the CPU (gloo, float32
learner), which is how the test suite keeps this script working (`tests/test_gpu_smoke.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

GIB = 2**30


@dataclass
class Row:
    """One section's outcome: `status` is ok, FAIL or skipped; `facts` are its measured numbers."""

    section: str
    status: str = "ok"
    seconds: float = 0.0
    facts: dict = field(default_factory=dict)
    note: str = ""


@dataclass
class Shared:
    """What a section hands the next ones."""

    model: str = ""
    device: torch.device = torch.device("cpu")
    engine: object = None
    prompts: list = field(default_factory=list)
    samples: list = field(default_factory=list)  # (prompt ids, GenerationOutput)
    teacher_logprobs: list = field(default_factory=list)
    learner: object = None
    merged_bytes: int = 0  # of the full (merged) bundle the weights section pushed
    merged_probe: list = field(default_factory=list)  # the engine's probe logprobs after that push


def gpu_memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {
        "alloc_gib": round(torch.cuda.memory_allocated() / GIB, 3),
        "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
    }


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gaps(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    d = np.abs(np.concatenate(a).astype(np.float64) - np.concatenate(b).astype(np.float64))
    return {"mean": float(d.mean()), "max": float(d.max())}


def build(args, s: Shared, row: Row) -> None:
    from scale_models import SIZES, build_model

    s.model = str(Path(args.work) / args.size)
    facts = build_model(s.model, SIZES[args.size])
    row.facts = {"params_m": round(facts["params"] / 1e6, 1), "vocab": facts["vocab_size"]}


def generate(args, s: Shared, row: Row) -> None:
    from rollout_workers.config import RolloutConfig, SamplingConfig
    from rollout_workers.hf_engine import HFEngine

    s.engine = HFEngine(s.model, RolloutConfig(dtype=args.engine_dtype, torch_threads=args.threads))
    s.device = s.engine._device
    vocab = s.engine.vocab_size
    rng = np.random.default_rng(0)
    s.prompts = [rng.integers(3, vocab, size=int(rng.integers(16, 65))) for _ in range(args.prompts)]
    sampling = SamplingConfig(n=args.n, max_new_tokens=args.max_new, temperature=1.0)
    s.engine.generate(s.prompts[:1], sampling.model_copy(update={"n": 1, "max_new_tokens": 4}), seed=1)
    reset_peak()
    t0 = time.perf_counter()
    outs = s.engine.generate(s.prompts, sampling, seed=7)
    sync()
    dt = time.perf_counter() - t0
    s.samples = [(p, o) for p, group in zip(s.prompts, outs, strict=True) for o in group]
    tokens = sum(len(o.response_ids) for _, o in s.samples)
    row.facts = {"sequences": len(s.samples), "new_tokens": tokens, "tokens_per_s": round(tokens / dt, 1)}
    row.facts.update(gpu_memory())
    row.seconds = dt


def behaviour_gaps(args, s: Shared, row: Row) -> None:
    from transformers import AutoModelForCausalLM

    from kernel.sequences import right_padded, sequence_logprobs

    sequences = [np.concatenate([p, o.response_ids]) for p, o in s.samples]
    teacher = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32, local_files_only=True)
    teacher = teacher.to(s.device).eval()
    teacher_lp = []
    with torch.inference_mode():
        for start in range(0, len(sequences), 8):
            ids, mask = right_padded(sequences[start : start + 8], s.device)
            logits = teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits
            for lg, r, n in zip(logits, ids, mask.sum(-1).tolist(), strict=True):
                teacher_lp.append(sequence_logprobs(lg[:n].float(), r[:n]).cpu().numpy())
    del teacher
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    own_lp = s.engine.probe_logprobs(sequences)  # the engine's teacher-forced bf16 forward
    behaviour = [o.logprobs for _, o in s.samples]
    cut = [len(p) - 1 for p, _ in s.samples]  # logprobs of tokens 1..: responses start at len(p)-1
    s.teacher_logprobs = [t[c:] for t, c in zip(teacher_lp, cut, strict=True)]
    vs_teacher = gaps(behaviour, s.teacher_logprobs)
    vs_own = gaps(behaviour, [t[c:] for t, c in zip(own_lp, cut, strict=True)])
    row.facts = {
        "vs_fp32_mean": round(vs_teacher["mean"], 5),
        "vs_fp32_max": round(vs_teacher["max"], 4),
        "vs_own_forward_mean": round(vs_own["mean"], 5),
        "vs_own_forward_max": round(vs_own["max"], 4),
        "logprob_mean": round(float(np.concatenate(behaviour).mean()), 3),
    }
    limit = 0.05 if args.engine_dtype != "float32" else 1e-3  # bf16 rounding; misalignment is O(1)
    if not vs_teacher["mean"] <= limit:
        row.status, row.note = "FAIL", f"mean gap to the float32 forward above {limit}"


def sleep_wake(args, s: Shared, row: Row) -> None:
    from rollout_workers.config import SamplingConfig

    sampling = SamplingConfig(n=2, max_new_tokens=16)
    before = s.engine.generate(s.prompts[:2], sampling, seed=3)
    sync()
    awake = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    s.engine.sleep(1)
    asleep = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    s.engine.wake_up()
    after = s.engine.generate(s.prompts[:2], sampling, seed=3)
    same = all(
        np.array_equal(a.response_ids, b.response_ids)
        for ga, gb in zip(before, after, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    row.facts = {
        "awake_gib": round(awake / GIB, 3),
        "asleep_gib": round(asleep / GIB, 3),
        "same_tokens": same,
    }
    if not same:
        row.status, row.note = "FAIL", "the same seed sampled other tokens after waking"
    elif torch.cuda.is_available() and not asleep < awake:
        row.status, row.note = "FAIL", "sleeping freed no GPU memory"


def learner_steps(args, s: Shared, row: Row) -> None:
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means the section cannot run
        row.status, row.note = "skipped", f"deepspeed does not import: {err}"
        return
    from learner.config import LearnerConfig, LoRAConfig
    from learner.deepspeed_setup import free_port
    from learner.rank import LearnerRank
    from learner.trajectory import Trajectory

    attn = "sdpa"
    try:
        import flash_attn  # noqa: F401

        attn = "flash_attention_2" if s.device.type == "cuda" else attn
    except ImportError:
        pass
    config = LearnerConfig(
        zero_stage=args.zero_stage,
        dtype=args.learner_dtype,
        pack_sequences=True,
        max_tokens_per_micro_batch=args.micro_tokens,
        attn_implementation=attn,
        logits_chunk_tokens=None if args.logits_chunk == "none" else args.logits_chunk,
        gradient_checkpointing=args.gradient_checkpointing,
        torch_threads=args.threads,
        dist_timeout_s=600,
        lora=LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora_rank else LoRAConfig(),
    )
    rng = np.random.default_rng(1)
    trajectories = [
        Trajectory(
            np.asarray(p, dtype=np.int64),
            np.asarray(o.response_ids, dtype=np.int64),
            np.asarray(o.logprobs, dtype=np.float32),
            np.asarray(ref, dtype=np.float32),
            float(rng.choice([-1.0, 1.0])),
            group=i // args.n,
        )
        for i, ((p, o), ref) in enumerate(zip(s.samples, s.teacher_logprobs, strict=True))
    ]
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    s.learner = LearnerRank(0, 1, s.model, config, seed=0, pad_token_id=0)
    t0 = time.perf_counter()
    s.learner.setup("127.0.0.1", free_port())
    setup_s = time.perf_counter() - t0
    reset_peak()
    times, first = [], None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = s.learner.train_step(trajectories)
        sync()
        times.append(time.perf_counter() - t0)
        first = first or metrics
    steady = times[1:] or times
    row.seconds = sum(times)
    module = s.learner.engine.module
    row.facts = {
        "attention": attn,
        "zero_stage": args.zero_stage,
        "lora_rank": args.lora_rank,
        "trainable_params": sum(
            getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad
        ),
        "logits_chunk": args.logits_chunk,
        "gradient_checkpointing": args.gradient_checkpointing,
        "setup_s": round(setup_s, 1),
        "tokens_per_step": tokens,
        "step_s": [round(t, 2) for t in times],
        "tokens_per_s": round(tokens / (sum(steady) / len(steady)), 1),
        "first_logprob_gap": round(float(first.get("rollout/logprob_gap", float("nan"))), 5),
        "first_approx_kl": round(float(first.get("params/approx_kl", float("nan"))), 6),
        "grad_norm": round(float(metrics.get("params/grad_norm", float("nan"))), 4),
    }
    row.facts.update(gpu_memory())
    if not all(np.isfinite(v) for v in metrics.values() if isinstance(v, float)):
        row.status, row.note = "FAIL", "a non-finite training metric"


def push(args, s: Shared, engine, adapter: bool = False) -> tuple[dict, list, int, str | None]:
    """Export from the learner (the adapter alone with `adapter`: what the cluster sets from
    rollout.lora_sync='adapter'), load it into `engine`, time both, and check the engine's digest
    against the bundle's and its probe logprobs against the learner's. Returns the facts, the engine's
    probe logprobs, the bundle's bytes and why the push failed (None: it passed)."""
    from kernel.sequences import probe_sequences
    from rollout_workers.weights import sampled_digest, torch_dtype

    s.learner.config.export_adapter = adapter
    try:
        t0 = time.perf_counter()
        state = s.learner.export_weights(dtype=args.engine_dtype)
        export_s = time.perf_counter() - t0
    finally:
        s.learner.config.export_adapter = False
    t0 = time.perf_counter()
    (engine.load_adapter if adapter else engine.load_weights)(state)
    sync()
    load_s = time.perf_counter() - t0
    held = engine.adapter_digest() if adapter else engine.weights_digest()
    matches = held == sampled_digest(state.items(), torch_dtype(args.engine_dtype))
    probe = engine.probe_logprobs(probe_sequences(engine.vocab_size))
    fingerprint = s.learner.export_fingerprint()
    gap = gaps(probe, fingerprint["probe"])
    nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    facts = {
        "bundle_mib": round(nbytes / 2**20, 2),
        "export_s": round(export_s, 2),
        "load_s": round(load_s, 3),
        "digest_matches": matches,
        "probe_gap_max": round(gap["max"], 4),
        **{k: round(v, 2) for k, v in fingerprint["timings"].items()},
    }
    why = None
    if not matches:
        why = "the engine's digest differs from the bundle's after the load"
    elif not gap["max"] <= (0.1 if args.engine_dtype != "float32" else 1e-3):
        why = "the engine's probe logprobs disagree with the learner's"
    return facts, probe, nbytes, why


def weights(args, s: Shared, row: Row) -> None:
    if s.learner is None:
        row.status, row.note = "skipped", "no learner (its section did not run)"
        return
    before = s.engine.weights_digest()
    row.facts, s.merged_probe, s.merged_bytes, why = push(args, s, s.engine)
    row.facts["digest_changed"] = s.engine.weights_digest() != before
    if why:
        row.status, row.note = "FAIL", why


def adapter_weights(args, s: Shared, row: Row) -> None:
    """rollout.lora_sync='adapter': the learner exports the adapter alone, a second engine (the base
    weights) applies it; bytes and seconds against the merged push of the section before."""
    if not args.lora_rank:
        row.status, row.note = "skipped", "needs --lora-rank (a LoRA learner)"
        return
    from rollout_workers.config import RolloutConfig
    from rollout_workers.hf_engine import HFEngine

    engine = HFEngine(s.model, RolloutConfig(dtype=args.engine_dtype, torch_threads=args.threads))
    row.facts, probe, nbytes, why = push(args, s, engine, adapter=True)
    del engine
    row.facts["of_merged_bundle"] = round(nbytes / (s.merged_bytes or float("nan")), 4)
    row.facts["vs_merged_engine_max"] = round(gaps(probe, s.merged_probe)["max"], 4)
    if why:
        row.status, row.note = "FAIL", why


SECTIONS = [
    ("build", build),
    ("generate", generate),
    ("behaviour logprobs", behaviour_gaps),
    ("sleep/wake", sleep_wake),
    ("learner", learner_steps),
    ("weights", weights),
    ("adapter weights", adapter_weights),
]
NEEDS = {
    "generate": "build",
    "behaviour logprobs": "generate",
    "sleep/wake": "generate",
    "learner": "behaviour logprobs",
    "adapter weights": "weights",
}


def run(args) -> list[Row]:
    s, rows = Shared(), {}
    for name, fn in SECTIONS:
        row = rows[name] = Row(name)
        need = NEEDS.get(name)
        if need and rows[need].status != "ok":
            row.status, row.note = "skipped", f"needs '{need}'"
        else:
            t0 = time.perf_counter()
            try:
                fn(args, s, row)
            except Exception as err:  # noqa: BLE001 - the smoke reports every section's failure
                row.status, row.note = "FAIL", f"{type(err).__name__}: {err}"
                traceback.print_exc()
            row.seconds = row.seconds or time.perf_counter() - t0
        print(format_row(row), flush=True)
    if s.learner is not None:
        s.learner.shutdown()
    return list(rows.values())


def format_row(row: Row) -> str:
    facts = ", ".join(f"{k}={v}" for k, v in row.facts.items())
    note = f"  [{row.note}]" if row.note else ""
    return f"| {row.section:<18} | {row.status:<7} | {row.seconds:8.2f} s | {facts}{note}"


def machine() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    import transformers

    out["transformers"] = transformers.__version__
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except Exception:  # noqa: BLE001
        out["deepspeed"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="qwen2-0.5b" if gpu else "tiny-qwen2")
    p.add_argument("--prompts", type=int, default=32 if gpu else 2)
    p.add_argument("--n", type=int, default=4 if gpu else 2)
    p.add_argument("--max-new", type=int, default=256 if gpu else 8)
    p.add_argument("--steps", type=int, default=3 if gpu else 1)
    p.add_argument("--zero-stage", type=int, choices=(2, 3), default=2)
    p.add_argument("--micro-tokens", type=int, default=16384 if gpu else 512)
    p.add_argument(
        "--logits-chunk",
        default="auto",
        type=lambda v: v if v in ("auto", "none") else int(v),
        help="learner.logits_chunk_tokens: auto (default), none (full logits) or a number of positions",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="learner.lora.rank (alpha 2 x rank, all-linear): the learner trains adapters, exports merged",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="learner.gradient_checkpointing: recompute each layer's activations in the backward pass",
    )
    p.add_argument("--engine-dtype", default="bfloat16" if gpu else "float32")
    p.add_argument("--learner-dtype", default="bfloat16" if gpu else "float32")
    p.add_argument("--threads", type=int, default=8 if gpu else 1)
    p.add_argument("--work", default=None, help="folder for the built model (default: a temporary one)")
    p.add_argument("--out", default=None, help="folder for gpu_smoke.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        args.work = args.work or tmp
        facts = machine()
        print(json.dumps(facts), flush=True)
        print(f"| {'section':<18} | status  | {'time':>10} | facts", flush=True)
        rows = run(args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report = {"machine": facts, "args": vars(args), "rows": [asdict(r) for r in rows]}
        (Path(args.out) / "gpu_smoke.json").write_text(json.dumps(report, indent=1, default=str))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
