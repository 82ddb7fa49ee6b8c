"""Rollout routing replay on the tiny MoE families, side by side in one run (make bench-moe; issue 61).

    .venv/bin/python bench/bench_moe.py [--seeds 0 1 2] [--prompts 16] [--n 2] [--max-new-tokens 8]
        [--noise 0.15] [--engine-dtype float32] [--lr 1e-3] [--out runs/bench-moe]

Per family (tests/tiny_models: Qwen3-MoE and Mixtral, 2 layers, 4 experts, top-2, random weights built
with the run seed) and per run seed: the hf engine (`RolloutWorker`, `rollout.record_routing`) samples
`--prompts` random prompts x `--n` from a copy of the policy whose routers got Gaussian noise of
`--noise` x each router weight's std (and, with `--engine-dtype bfloat16`, in bf16): a deliberate
engine/learner mismatch. The same samples then go through one real learner step per
`learner.router_replay` (none, R2, R3): a `LearnerRank` in this process (world of 1, gloo, DeepSpeed
ZeRO-2), GRPO, 1 epoch of 2 minibatches (one optimizer step between them). Measured per step:

- `differ`: the share of (token, layer) top-k expert sets of the learner's proximal pass that differ
  from the engine's, over the tokens the engine routed (prompt + response but the last);
- `gap`, `kl_k1`, `kl_k3`: the step's own metrics `rollout/logprob_gap` (mean |log pi_prox - log mu|),
  `off_policy/behaviour_kl_k1` and `off_policy/behaviour_kl` (k3), computed by the learner
  (`learner.corrections.correction_weights`), not here;
- `drift`: the share of expert sets of the second minibatch's forward (after the optimizer step) that
  differ from the proximal pass's on the same tokens: what R2 replays away;
- `router |grad|`: the norm of the routers' weight gradients summed over the step's backward passes
  (a hook on each router weight), and `router moved`: ||W_after - W_before|| / ||W_before||.

Routing is read where the experts receive it (a pre-hook on each MoE block's experts module, after
every router hook), and tokens are matched to the samples by their ids. Results: a markdown table of
mean +- spread (min..max over seeds) on stdout, and results.json with --out. Nothing is asserted here
(tests/test_bench_moe.py runs it tiny and asserts R3's agreement).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tiny_models import MOE_FAMILIES, build_causal_lm  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from cluster.records.trajectories import to_trajectory  # noqa: E402
from kernel.moe_routing import moe_routers  # noqa: E402
from learner.config import KLConfig, LearnerConfig  # noqa: E402
from learner.rank import LearnerRank  # noqa: E402
from rollout_workers.config import RolloutConfig, SamplingConfig  # noqa: E402
from rollout_workers.worker import RolloutWorker  # noqa: E402

MODES = ("none", "R2", "R3")


@dataclasses.dataclass(frozen=True)
class Setting:
    prompts: int = 16
    n: int = 2
    max_new_tokens: int = 8
    noise: float = 0.15
    engine_dtype: str = "float32"
    lr: float = 1e-3


@dataclasses.dataclass(frozen=True)
class Row:
    family: str
    mode: str
    seed: int
    differ: float  # share of the engine-routed (token, layer) sets the proximal pass routes elsewhere
    sets: int  # how many (token, layer) sets that share is over
    gap: float
    kl_k1: float
    kl_k3: float
    drift: float  # share of sets the second minibatch routes elsewhere than the proximal pass
    router_grad: float
    router_moved: float


def engine_samples(folder: Path, family: str, seed: int, s: Setting) -> tuple[Path, list]:
    """The learner's model folder and the samples (with routing) of an engine whose routers got noise."""
    learner_dir = build_causal_lm(folder / "learner", family, seed=seed)
    engine_dir = build_causal_lm(folder / "engine", family, seed=seed)
    noisy = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for router in moe_routers(noisy):
            w = router.weight
            w.add_(s.noise * w.std() * torch.randn(w.shape, generator=gen))
    noisy.save_pretrained(engine_dir)
    vocab = noisy.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, vocab, int(rng.integers(2, 10))) for _ in range(s.prompts)]
    worker = RolloutWorker(
        str(engine_dir),
        RolloutConfig(engine="hf", record_routing=True, dtype=s.engine_dtype),
        initial_version=0,
    )
    sampling = SamplingConfig(n=s.n, max_new_tokens=s.max_new_tokens, temperature=1.0)
    return learner_dir, worker.generate(list(range(s.prompts)), prompts, seed=seed, sampling=sampling)


@contextlib.contextmanager
def routed(model: torch.nn.Module) -> Iterator[list[dict[tuple, torch.Tensor]]]:
    """Inside, every padded forward of `model` (a `PolicyWithValueHead`) appends {token ids of a row:
    its tokens' experts [tokens, layers, k] as the experts modules received them}."""
    blocks = [m for m in model.modules() if getattr(m, "gate", None) in moe_routers(model)]
    forwards: list[dict[tuple, torch.Tensor]] = []
    current: dict = {}

    def start(module, args, kwargs):
        current["ids"], current["attn"], current["layers"] = args[0], args[1], []

    def expert_input(module, args, kwargs):
        current["layers"].append((args[1] if len(args) > 1 else kwargs["top_k_index"]).detach())

    def end(module, args, kwargs, out):
        ids, attn = current["ids"], current["attn"].bool()
        B, L = ids.shape
        index = torch.stack(current["layers"], dim=1).view(B, L, len(blocks), -1)
        forwards.append({tuple(ids[r][attn[r]].tolist()): index[r][attn[r]].cpu() for r in range(B)})

    handles = [
        model.register_forward_pre_hook(start, with_kwargs=True),
        model.register_forward_hook(end, with_kwargs=True),
        *(b.experts.register_forward_pre_hook(expert_input, with_kwargs=True) for b in blocks),
    ]
    try:
        yield forwards
    finally:
        for h in handles:
            h.remove()


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many (token, layer) rows of [tokens, layers, k] expert indices hold another set in `b`."""
    return int((a.long().sort(-1).values != b.long().sort(-1).values).any(-1).sum())


def learner_step(path: Path, samples: list, mode: str, s: Setting) -> dict:
    """One real learner step (a LearnerRank, world of 1) under `learner.router_replay` `mode`."""
    config = LearnerConfig(
        lr=s.lr,
        advantage="grpo",
        ppo_epochs=1,
        num_minibatches=2,
        micro_batch_size=len(samples),
        router_replay=mode,
        kl=KLConfig(coef=0.0),
        entropy_coef=0.0,
        pack_sequences=False,
    )
    rng = np.random.default_rng(0)
    trajs = [to_trajectory(x, x.logprobs, float(rng.normal()), group=int(x.prompt_index)) for x in samples]
    rank = LearnerRank(0, 1, str(path), config, seed=0, pad_token_id=0, temperature=1.0)
    rank.setup(*rank.node_address())  # a second setup in this process adopts the world it holds
    try:
        module = rank.engine.module
        routers = moe_routers(module)
        before = [r.weight.detach().clone() for r in routers]
        grads: list[float] = []
        hooks = [r.weight.register_hook(lambda g: grads.append(float(g.norm()))) for r in routers]
        with routed(module) as forwards:
            metrics = rank.train_step(trajs)
        for h in hooks:
            h.remove()
        moved = sum(float((r.weight.detach() - b).norm()) for r, b in zip(routers, before, strict=True))
        norm = sum(float(b.norm()) for b in before)
    finally:
        rank.engine.destroy()
    return {
        "metrics": metrics,
        "forwards": forwards,
        "router_grad": sum(grads),
        "router_moved": moved / norm,
    }


def measure(family: str, seed: int, s: Setting) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path, samples = engine_samples(Path(tmp), family, seed, s)
        engine = {
            tuple(np.concatenate([x.prompt_ids, x.response_ids]).tolist()): torch.from_numpy(x.routing)
            for x in samples
        }
        for mode in MODES:
            out = learner_step(path, samples, mode, s)
            prox, *ppo = out["forwards"]  # the proximal pass, then one forward per minibatch
            differ = drift = sets = drift_sets = 0
            for seq, want in engine.items():
                n = want.shape[0]  # the tokens the engine routed: all but the last
                differ += differing(prox[seq][:n], want)
                sets += want.numel() // want.shape[-1]
            for seq, got in ppo[-1].items():  # the minibatch after the optimizer step
                n = engine[seq].shape[0]
                drift += differing(got[:n], prox[seq][:n])
                drift_sets += n * got.shape[1]
            m = out["metrics"]
            rows.append(
                Row(
                    family,
                    mode,
                    seed,
                    differ / sets,
                    sets,
                    m["rollout/logprob_gap"],
                    m["off_policy/behaviour_kl_k1"],
                    m["off_policy/behaviour_kl"],
                    drift / max(drift_sets, 1),
                    out["router_grad"],
                    out["router_moved"],
                )
            )
    return rows


def _stat(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return format(mean, fmt)
    return f"{format(mean, fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


def table(rows: list[Row]) -> str:
    lines = [
        "| family | router_replay | expert sets differing from the engine's | mean abs logprob gap "
        "| behaviour KL k1 | behaviour KL k3 | sets moved by the optimizer step (drift) "
        "| router grad norm | router moved (relative) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family in dict.fromkeys(r.family for r in rows):
        for mode in MODES:
            rs = [r for r in rows if r.family == family and r.mode == mode]
            lines.append(
                f"| {family} | {mode} | {_stat([100 * r.differ for r in rs], '.1f')} % "
                f"| {_stat([r.gap for r in rs], '.4f')} | {_stat([r.kl_k1 for r in rs], '.4f')} "
                f"| {_stat([r.kl_k3 for r in rs], '.4f')} | {_stat([100 * r.drift for r in rs], '.1f')} % "
                f"| {_stat([r.router_grad for r in rs], '.3g')} | {_stat([r.router_moved for r in rs], '.2e')} |"
            )
    return "\n".join(lines)


def run(families: list[str], seeds: list[int], s: Setting) -> list[Row]:
    torch.set_num_threads(1)
    return [r for family in families for seed in seeds for r in measure(family, seed, s)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(MOE_FAMILIES), choices=list(MOE_FAMILIES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=Setting.prompts)
    ap.add_argument("--n", type=int, default=Setting.n)
    ap.add_argument("--max-new-tokens", type=int, default=Setting.max_new_tokens)
    ap.add_argument("--noise", type=float, default=Setting.noise)
    ap.add_argument("--engine-dtype", default=Setting.engine_dtype, choices=["float32", "bfloat16"])
    ap.add_argument("--lr", type=float, default=Setting.lr)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    s = Setting(a.prompts, a.n, a.max_new_tokens, a.noise, a.engine_dtype, a.lr)
    rows = run(a.families, a.seeds, s)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{when}, {os.cpu_count()}-core {platform.machine()} CPU, seeds {a.seeds}, {dataclasses.asdict(s)}")
    print(table(rows))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        record = {
            "when": when,
            "setting": dataclasses.asdict(s),
            "rows": [dataclasses.asdict(r) for r in rows],
        }
        (a.out / "results.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
