"""The compute of PPO iterations in one process without Ray: the floor the distributed run is held to.

The role classes run in-process, one after the other, on the same prompts, sampling seeds and
thread counts as the actors: RolloutWorker (generate), ReferencePolicy (reference forward),
RewardScorer (reward forward), a 1-rank LearnerRank (DeepSpeed ZeRO PPO update: proximal pass and
forward/backward), then the weight export and load into the worker. Their sum per iteration is the
"standalone compute" that `bench/compare_trl.py` sets beside the end-to-end iteration time.

    .venv/bin/python bench/standalone.py [--config configs/sentiment_tiny.yaml] [--steps 20] [--set k=v]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cluster.config.schema import RunConfig, load_config  # noqa: E402
from cluster.pipeline.collector import chunk_seed  # noqa: E402
from cluster.prompts.loader import PromptStream, read_prompts, tokenize_prompts  # noqa: E402
from learner.batch import Trajectory  # noqa: E402
from learner.deepspeed_setup import free_port  # noqa: E402
from learner.rank import LearnerRank  # noqa: E402
from reward_service.reference import ReferencePolicy  # noqa: E402
from reward_service.scorer import RewardScorer  # noqa: E402
from rollout_workers.worker import RolloutWorker  # noqa: E402

PHASES = ("generate", "reference", "reward", "train", "weights")


@dataclass
class StandaloneResult:
    steps: list[dict[str, float]] = field(default_factory=list)  # per-phase seconds, reward, samples
    setup_s: float = 0.0

    def mean(self, phase: str, skip: int = 0) -> float:
        rows = self.steps[skip:] or self.steps
        return statistics.fmean(r[phase] for r in rows)

    def compute_per_step(self, skip: int = 0) -> float:
        """Mean seconds of one iteration's work: every phase, run back to back."""
        return sum(self.mean(p, skip) for p in PHASES)


def _timed(threads: int, fn, *args):
    """Run `fn` with the thread count its actor would use (one process: torch's setting is global)."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _sync(learner: LearnerRank, worker: RolloutWorker, version: int) -> None:
    """The weight push without Ray: export from the learner, load (and checksum) in the worker."""
    worker.load_weights(learner.export_weights(), version)


def run_standalone(cfg: RunConfig, steps: int) -> StandaloneResult:
    """`steps` real PPO iterations of `cfg`'s work, timed per phase."""
    t0 = time.perf_counter()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
    prompts, _ = tokenize_prompts(read_prompts(cfg.data), tok, cfg.data)
    stream = PromptStream(prompts, cfg.run.seed, cfg.data.shuffle)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    temperature = cfg.rollout.sampling.temperature
    worker = RolloutWorker(cfg.model.policy_path, cfg.rollout, 0, 0)
    resolved = cfg.resolved  # the sections as the cluster starts the roles with them
    reference = ReferencePolicy(cfg.reference_path, resolved.reference, temperature)
    scorer = RewardScorer(cfg.reward, cfg.tokenizer_path)
    learner = LearnerRank(0, 1, cfg.model.policy_path, resolved.learner, cfg.run.seed, pad, temperature)
    learner.setup("127.0.0.1", free_port())
    result = StandaloneResult(setup_s=time.perf_counter() - t0)
    t_roll, t_lrn = cfg.rollout.torch_threads, cfg.learner.torch_threads
    try:
        for step in range(1, steps + 1):
            batch = stream.next_batch(cfg.data.prompts_per_step)
            times = dict.fromkeys(PHASES, 0.0)
            trajectories: list[Trajectory] = []
            scores: list[float] = []
            size = cfg.rollout.chunk_size
            for ci, start in enumerate(range(0, len(batch), size)):
                chunk = batch[start : start + size]
                seed = chunk_seed(cfg.run.seed, step, ci)
                samples, dt = _timed(
                    t_roll, worker.generate, [p.index for p in chunk], [p.ids for p in chunk], seed
                )
                times["generate"] += dt
                p_ids = [s.prompt_ids for s in samples]
                r_ids = [s.response_ids for s in samples]
                # The reference and reward actors run one thread (their constructors' default).
                ref_lps, dt = _timed(1, reference.logprobs, p_ids, r_ids)
                times["reference"] += dt
                by_index = {p.index: p.meta for p in chunk}
                meta = [by_index[s.prompt_index] for s in samples]
                scored, dt = _timed(1, scorer.score, p_ids, r_ids, meta)
                times["reward"] += dt
                for j, s in enumerate(samples):
                    if not scored.ok[j]:
                        continue
                    scores.append(float(scored.scores[j]))
                    trajectories.append(
                        Trajectory(
                            s.prompt_ids, s.response_ids, s.logprobs, ref_lps[j], float(scored.scores[j])
                        )
                    )
            metrics, times["train"] = _timed(t_lrn, learner.train_step, trajectories)

            _, times["weights"] = _timed(t_roll, _sync, learner, worker, step)
            tokens = sum(len(t.response_ids) for t in trajectories)
            probs = torch.sigmoid(torch.tensor(scores)).mean().item() if scores else float("nan")
            result.steps.append(
                {
                    **times,
                    "step": step,
                    "samples": float(len(trajectories)),
                    "tokens": float(tokens),
                    "reward_mean": statistics.fmean(scores) if scores else float("nan"),
                    "reward_prob_mean": probs,
                    "kl": float(metrics.get("objective/kl", float("nan"))),
                }
            )
    finally:
        learner.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/sentiment_tiny.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the means")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=None, help="also write the per-step JSON here")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if cfg.model.demo_assets:
        from demos import ensure_demo

        ensure_demo(cfg.model.demo_assets.demo, cfg.model.demo_assets.folder, quiet=True)
    res = run_standalone(cfg, args.steps)
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(res), indent=1))
    w = min(args.warmup, max(len(res.steps) - 1, 0))
    print(f"standalone: {len(res.steps)} iterations ({w} warm-up left out), set-up {res.setup_s:.1f}s")
    for p in PHASES:
        print(f"  {p:<10}{res.mean(p, w):>8.3f} s")
    print(f"  {'total':<10}{res.compute_per_step(w):>8.3f} s per iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
