"""Held-out evaluation: the `eval:` section's prompts, scored with the current weights between steps.

Evaluation goes through the rollout path of training (the same workers, `generate`, the same reward
scorers) with its own sampling (n = eval.samples_per_prompt; greedy or the rollouts' temperature) and
no reference pass; its samples never reach the learner. Every evaluation of a run uses the same
chunk seeds, so the before/after comparison draws with the same random numbers (common random numbers).
"""

from __future__ import annotations

import numpy as np

from rollout_workers.config import SamplingConfig

from .config import RunConfig
from .data import Prompt, read_prompts, tokenize_prompts
from .summary import reward_to_prob

# The chunk-seed "step" of every evaluation chunk: far from any training step's seeds.
EVAL_SEED_STEP = 10**9


def load_eval_prompts(cfg: RunConfig, tokenizer) -> list[Prompt]:
    """The held-out prompts (`eval.prompts_path`, first `eval.max_prompts`), tokenized like the data's;
    [] when evaluation is off."""
    if not cfg.eval.enabled:
        return []
    section = cfg.data.model_copy(update={"prompts_path": cfg.eval.prompts_path})
    prompts, _stats = tokenize_prompts(read_prompts(section), tokenizer, section)
    return prompts[: cfg.eval.max_prompts]


def eval_sampling(cfg: RunConfig) -> SamplingConfig:
    """The rollouts' sampling with eval's n; greedy is top-k 1 (the argmax, whatever the temperature)."""
    update: dict = {"n": cfg.eval.samples_per_prompt}
    if cfg.eval.greedy:
        update.update(top_k=1, top_p=1.0)
    return cfg.rollout.sampling.model_copy(update=update)


def eval_metrics(cfg: RunConfig, scores: np.ndarray, lengths: np.ndarray, versions: list[int]) -> dict:
    """eval/reward_mean and eval/response_length; eval/accuracy for rule rewards (reward >= eval.correct_at);
    eval/reward_prob_mean for classifier rewards; eval/policy_version: the oldest weights that answered."""
    m = {
        "eval/reward_mean": float(scores.mean()) if len(scores) else float("nan"),
        "eval/response_length": float(lengths.mean()) if len(lengths) else float("nan"),
        "eval/samples": float(len(scores)),
        "eval/policy_version": float(min(versions)) if versions else float("nan"),
    }
    if cfg.reward.kind == "rule":
        m["eval/accuracy"] = float(np.mean(scores >= cfg.eval.correct_at)) if len(scores) else float("nan")
    probs = reward_to_prob(scores, cfg.reward.kind, cfg.reward.score)
    if probs is not None:
        m["eval/reward_prob_mean"] = float(probs.mean()) if len(probs) else float("nan")
    return m


def headline(m: dict) -> str:
    """One line of an evaluation's numbers, in the reward's own units."""
    parts = [f"reward mean {m['eval/reward_mean']:+.3f}"]
    if "eval/accuracy" in m:
        parts.append(f"accuracy {m['eval/accuracy']:.3f}")
    if "eval/reward_prob_mean" in m:
        parts.append(f"P(positive) {m['eval/reward_prob_mean']:.3f}")
    parts.append(f"{int(m['eval/samples'])} samples")
    return ", ".join(parts)


def before_after_lines(before: dict | None, after: dict | None, what: str) -> list[str]:
    """'before -> after' of each shared eval number (the run summary's held-out lines)."""
    if not before or not after:
        return []
    keys = ["eval/reward_mean", "eval/accuracy", "eval/reward_prob_mean"]
    cells = [
        f"{k.split('/')[1]} {before[k]:.3f} -> {after[k]:.3f}" for k in keys if k in before and k in after
    ]
    return [f"{what}: " + ", ".join(cells)]
