"""Held-out evaluation: the `eval:` section's prompts, scored with the current weights between steps.

Evaluation goes through the rollout path of training (the same workers, `generate`, the same reward
scorers) with its own sampling (n = eval.samples_per_prompt; greedy or the rollouts' temperature) and
no reference pass; its samples never reach the learner. Every evaluation of a run uses the same
chunk seeds, so the before/after comparison draws with the same random numbers (common random numbers).
The metrics come from the chunks' facts and scores; only the few samples printed before and after
training are fetched to the driver.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray

from cluster.config.schema import RunConfig
from cluster.pipeline.collector import RolloutCollector
from cluster.prompts.loader import Prompt
from cluster.records.chunks import Chunk, Parts, RolloutBatch, chunk_seed, every_sample, kept
from cluster.reporting.metrics import episode_metrics, function_failure_metrics, function_metrics
from cluster.reporting.reward_failures import RewardFailureLog
from reward_service.backends import REWARD_KINDS, reward_to_prob
from rollout_workers.config import SamplingConfig

# The chunk-seed "step" of every evaluation chunk: far from any training step's seeds.
EVAL_SEED_STEP = 10**9


def eval_sampling(cfg: RunConfig) -> SamplingConfig:
    """The rollouts' sampling with eval's n; greedy is top-k 1 (the argmax, whatever the temperature)."""
    update: dict = {"n": cfg.eval.samples_per_prompt}
    if cfg.eval.greedy:
        update.update(top_k=1, top_p=1.0)
    return cfg.rollout.sampling.model_copy(update=update)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1): the probability
    that k of the n drawn without replacement hold at least one correct, 1 - C(n-c, k) / C(n, k).

    Computed as the product 1 - prod_{i=n-c+1..n} (1 - k/i) (their numpy estimator), which never forms a
    binomial coefficient; exactly 1 when n - c < k (every k-subset holds a correct sample)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def correctness_metrics(
    prompts: list[object], correct: list[bool], pass_k: list[int], n: int
) -> dict[str, float]:
    """eval/pass@k for each k of `pass_k` and eval/mean@n, from one correctness flag per sample and its
    prompt's key (samples of a prompt need not be adjacent; `eval_metrics` gives every sample, a failed
    one as wrong).

    A prompt with c correct of its m samples adds pass_at_k(m, c, k) to pass@k (prompts with m < k are
    left out of that k) and c/m to mean@n: both are averages over prompts, NaN when no prompt counts.
    With the same number of samples for every prompt, mean@n equals eval/accuracy."""
    counts: dict[object, list[int]] = collections.defaultdict(lambda: [0, 0])  # prompt -> [m, c]
    for key, ok in zip(prompts, correct, strict=True):
        counts[key][0] += 1
        counts[key][1] += int(bool(ok))
    out = {}
    for k in pass_k:
        values = [pass_at_k(m, c, k) for m, c in counts.values() if m >= k]
        out[f"eval/pass@{k}"] = float(np.mean(values)) if values else float("nan")
    means = [c / m for m, c in counts.values()]
    out[f"eval/mean@{n}"] = float(np.mean(means)) if means else float("nan")
    return out


def eval_metrics(cfg: RunConfig, parts: Parts) -> dict:
    """eval/reward_mean and eval/response_length over the scored samples; eval/accuracy (per sample),
    eval/pass@k (each k of eval.pass_k) and eval/mean@n (n = eval.samples_per_prompt) for rule rewards over
    EVERY sample, a sample being correct when its reward was scored and >= eval.correct_at (a sample whose
    reward or environment failed is a wrong answer, never left out); eval/reward_prob_mean for classifier
    rewards; eval/policy_version: the oldest weights that answered; eval/reward_failures: samples whose
    reward failed, and eval/reward_failures/<name> per reward function."""
    scored = kept(parts)
    scores = np.array([float(c.scores.scores[j]) for c, j in scored])
    lengths = np.array([c.facts[j].length for c, j in scored])
    versions = [c.facts[j].version for c, j in scored]
    m = {
        "eval/reward_mean": float(scores.mean()) if len(scores) else float("nan"),
        "eval/response_length": float(lengths.mean()) if len(lengths) else float("nan"),
        "eval/samples": float(len(scores)),
        "eval/policy_version": float(min(versions)) if versions else float("nan"),
        "eval/reward_failures": float(sum(len(pos) for _c, pos in parts) - len(scored)),
    }
    if REWARD_KINDS[cfg.reward.kind].accuracy:
        every = [(c, j) for c, pos in parts for j in pos]
        correct = [bool(c.scores.ok[j]) and c.scores.scores[j] >= cfg.eval.correct_at for c, j in every]
        m["eval/accuracy"] = float(np.mean(correct)) if every else float("nan")
        # a chunk never splits a prompt's samples
        prompts = [(c.index, c.facts[j].prompt_index) for c, j in every]
        m.update(correctness_metrics(prompts, correct, cfg.eval.pass_k, cfg.eval.samples_per_prompt))
    # every episode, failed ones included (as in training: eval/env/failures counts them)
    m.update(episode_metrics([c.facts[j] for c, pos in parts for j in pos], prefix="eval/"))
    m.update(function_metrics(scored, prefix="eval/"))
    m.update(function_failure_metrics(parts, prefix="eval/"))
    probs = reward_to_prob(scores, cfg.reward)
    if probs is not None:
        m["eval/reward_prob_mean"] = float(probs.mean()) if len(probs) else float("nan")
    return m


def evaluate(
    collector: RolloutCollector, prompts: list[Prompt], cfg: RunConfig, sampling: SamplingConfig | None = None
) -> tuple[dict[str, float], RolloutBatch]:
    """Generate and score `prompts` with the weights the workers hold now (no reference pass, the same
    chunk seeds every time, `eval_sampling` unless `sampling` is given). Returns eval/* metrics and the batch."""
    t0 = time.perf_counter()
    batch = collector.collect(
        prompts,
        EVAL_SEED_STEP,
        cfg.run.seed,
        cfg.rollout.chunk_size,
        sampling=sampling or eval_sampling(cfg),
        reference=False,
    )
    m = eval_metrics(cfg, batch.parts)
    m["time/eval"] = time.perf_counter() - t0
    return m, batch


class EvalRound:
    """One held-out evaluation of the streaming mode: its chunks (tagged `eval`, so they are scored by
    the reward only and never enter the trajectory buffer), and the metrics once all are scored."""

    def __init__(
        self, step: int, prompts: list[Prompt], cfg: RunConfig, failures: RewardFailureLog | None = None
    ) -> None:
        """`failures`: where the round's reward failures are shown and kept (None: printed only)."""
        self.step, self.cfg, self.t0, self.done = step, cfg, time.perf_counter(), 0
        self.failures = failures or RewardFailureLog(None)
        size, sampling = cfg.rollout.chunk_size, eval_sampling(cfg)
        self.chunks = [
            Chunk(
                -1 - ci,
                prompts[s : s + size],
                chunk_seed(cfg.run.seed, EVAL_SEED_STEP, ci),
                sampling=sampling,
                eval=True,
            )
            for ci, s in enumerate(range(0, len(prompts), size))
        ]

    def scored(self, chunk: Chunk) -> dict[str, float] | None:
        """Count a scored chunk of this round; the round's metrics when it was the last one."""
        if all(c is not chunk for c in self.chunks):
            return None  # a chunk of an abandoned round
        self.done += 1
        if self.done < len(self.chunks):
            return None
        parts = every_sample(self.chunks)
        self.failures.record(parts, f"held-out evaluation at step {self.step}")
        m = eval_metrics(self.cfg, parts)
        m["eval/requested_at_step"] = float(self.step)
        m["time/eval"] = time.perf_counter() - self.t0
        return m


def print_eval(title: str, metrics: dict | None, batch: RolloutBatch, tokenizer, cfg: RunConfig) -> None:
    """An evaluation's numbers and one sample of each of its first run.sample_log_count prompts (the same
    prompts and seeds before and after training)."""
    print(f"\n--- {title} ---", flush=True)
    if metrics is not None:
        print(headline(metrics), flush=True)
    scored, scores = batch.kept, batch.scores
    probs = reward_to_prob(scores, cfg.reward)
    # each prompt's first sample (a prompt's samples are consecutive in its chunk), when it was scored
    firsts = [
        i
        for i, (c, j) in enumerate(scored)
        if j == 0 or c.facts[j - 1].prompt_index != c.facts[j].prompt_index
    ]
    firsts = firsts[: cfg.run.sample_log_count]
    # only the chunks printed from come to the driver
    chunks = list({id(scored[i][0]): scored[i][0] for i in firsts}.values())
    samples = dict(zip(map(id, chunks), ray.get([c.samples_ref for c in chunks]), strict=True))
    for i in firsts:
        chunk, j = scored[i]
        s = samples[id(chunk)][j]
        prompt, response = shown(tokenizer, s.prompt_ids), shown(tokenizer, s.response_ids)
        extra = f", P(pos) {probs[i]:.3f}" if probs is not None else ""
        print(f"[reward {scores[i]:+.2f}{extra}] {prompt} || {response}", flush=True)


def shown(tokenizer, ids) -> str:
    """A sample's ids as the logs print them: plain text without special tokens, or for a tokenizer with a
    chat template the role markers kept (all special tokens but padding) and newlines written as \\n, so
    that a conversation stays on one line and its turns can be told apart."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.decode(ids, skip_special_tokens=True)
    kept = [int(t) for t in ids if int(t) != tokenizer.pad_token_id]
    return tokenizer.decode(kept).replace("\n", "\\n")


def headline(m: dict) -> str:
    """One line of an evaluation's numbers, in the reward's own units."""
    parts = [f"reward mean {m['eval/reward_mean']:+.3f}"]
    if "eval/accuracy" in m:
        parts.append(f"accuracy {m['eval/accuracy']:.3f}")
    parts += [f"{k[5:]} {m[k]:.3f}" for k in _pass_keys(m)]
    if "eval/reward_prob_mean" in m:
        parts.append(f"P(positive) {m['eval/reward_prob_mean']:.3f}")
    parts.append(f"{int(m['eval/samples'])} samples")
    return ", ".join(parts)


def before_after_lines(before: dict | None, after: dict | None, what: str) -> list[str]:
    """'before -> after' of each shared eval number (the run summary's held-out lines)."""
    if not before or not after:
        return []
    keys = ["eval/reward_mean", "eval/accuracy", *_pass_keys(before), "eval/reward_prob_mean"]
    cells = [
        f"{k.split('/')[1]} {before[k]:.3f} -> {after[k]:.3f}" for k in keys if k in before and k in after
    ]
    return [f"{what}: " + ", ".join(cells)]


def _pass_keys(m: dict) -> list[str]:
    """The eval/pass@k keys of `m` with k > 1 (pass@1 is the accuracy), by k (pass@2 before pass@10)."""
    keys = [k for k in m if k.startswith("eval/pass@") and k != "eval/pass@1"]
    return sorted(keys, key=lambda k: int(k.rsplit("@", 1)[1]))


class Evaluator:
    """Held-out evaluation of the weights the workers hold (both pipelines): when it is due, one
    evaluation, and the before/after reports. `make_collector` builds a sync collector over the run's
    pools (the async pipeline evaluates through its stream instead, with `EvalRound`)."""

    def __init__(
        self,
        cfg: RunConfig,
        tokenizer: Any,
        eval_prompts: list[Prompt],
        train_prompts: list[Prompt],
        make_collector: Callable[[], RolloutCollector],
        failures: RewardFailureLog | None = None,
    ) -> None:
        """`failures`: where reward failures are shown and kept (None: printed only)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.failures = failures or RewardFailureLog(None)
        self.prompts, self.train_prompts = eval_prompts, train_prompts
        self.make_collector = make_collector
        self.before: dict[str, float] | None = None  # held-out metrics of the initial weights
        self.after: dict[str, float] | None = None

    def due(self, step: int) -> bool:
        """Evaluate on the held-out prompts after this step? Never after the last: the run's 'after'
        evaluation is that step's (`Run.train`: summary.json's eval_after and a held-out-only row)."""
        every = self.cfg.eval.every_steps
        return bool(self.prompts) and every > 0 and step % every == 0 and step < self.cfg.run.steps

    def evaluate(self, when: str = "held-out evaluation") -> tuple[dict[str, float], RolloutBatch]:
        """Score the held-out prompts with the weights the workers hold now; never trained on. Reward
        failures go to `failures` as `when`'s."""
        m, batch = evaluate(self.make_collector(), self.prompts, self.cfg)
        self.failures.record(batch.parts, when)
        return m, batch

    def report(self, when: str) -> dict[str, float] | None:
        """Before/after training: the held-out evaluation (returned, and kept as `before`/`after`), or
        without held-out prompts the first training prompts sampled with a fixed seed (printed only)."""
        m = None
        if self.prompts:
            m, batch = self.evaluate(f"held-out evaluation {when} training")
            print_eval(f"held-out prompts {when} training", m, batch, self.tokenizer, self.cfg)
        elif self.cfg.run.sample_log_count:
            fixed = self.train_prompts[: self.cfg.run.sample_log_count]
            _, batch = evaluate(self.make_collector(), fixed, self.cfg, self.cfg.rollout.sampling)
            print_eval(f"fixed training prompts {when} training", None, batch, self.tokenizer, self.cfg)
        if when == "before":
            self.before = m
        else:
            self.after = m
        return m

    def summary_lines(self) -> list[str]:
        return before_after_lines(self.before, self.after, f"held-out ({len(self.prompts)} prompts)")
