"""TRL's PPOTrainer on the demo assets: the reference peer of `bench/compare_trl.py`.

Runs INSIDE the TRL virtual environment (.venv-trl: trl 1.12.0, torch 2.13.0) and imports nothing
of this project, so the two sides share only files: the demo assets, a JSON of prompt token ids in
the order this project uses them, and the JSON result written here.

    python bench/trl_runner.py run --policy P --reward R --prompts ids.json --out result.json [settings]
    python bench/trl_runner.py verify-reward --policy P --reward R --samples samples.json
    python bench/trl_runner.py plot --csv curves.csv --png curves.png

Reward: TRL reads one column from `model.score(hidden_states)` at the last non-pad token, which is
the EOS token when the response has one. This project's scorer decodes the policy ids without
special tokens and re-tokenizes them (adding BOS, no EOS), so the classifier reads the last text
token. `OneColumnReward` is the same classifier with a 1-column head W[pos] - W[neg] (so the column
is logit(pos) - logit(neg)) whose backbone hands the hidden state of the token before an EOS to the
EOS position: by causality that is exactly the state the classifier computes without the EOS.
`verify-reward` checks the equality through TRL's own `get_reward`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

# ----------------------------------------------------------------------------- models


def build_reward_model(reward_path: str, eos_id: int, positive_label: int = 1):
    """The 2-label classifier as a 1-column TRL reward model that scores what this project scores."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import ModelOutput

    clf = AutoModelForSequenceClassification.from_pretrained(reward_path, local_files_only=True)
    if clf.config.num_labels != 2:
        raise ValueError(f"{reward_path}: expected a 2-label classifier, got {clf.config.num_labels} labels")
    prefix = clf.base_model_prefix
    backbone = getattr(clf, prefix)
    w = clf.score.weight.detach()
    head = nn.Linear(w.shape[1], 1, bias=clf.score.bias is not None)
    with torch.no_grad():
        head.weight.copy_(w[positive_label] - w[1 - positive_label])
        if clf.score.bias is not None:
            head.bias.copy_(clf.score.bias[positive_label] - clf.score.bias[1 - positive_label])

    class SkipEosBackbone(nn.Module):
        """The classifier's backbone; an EOS position gets the hidden state of the token before it."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = backbone

        def forward(self, input_ids, attention_mask=None, **kwargs):
            kwargs["output_hidden_states"] = True
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            h = out.hidden_states[-1]
            is_eos = input_ids == eos_id
            if attention_mask is not None:
                is_eos = is_eos & attention_mask.bool()
            h = torch.where(is_eos.unsqueeze(-1), torch.roll(h, 1, dims=1), h)
            return ModelOutput(last_hidden_state=h, hidden_states=(h,))

    class OneColumnReward(nn.Module):
        base_model_prefix = prefix

        def __init__(self) -> None:
            super().__init__()
            setattr(self, prefix, SkipEosBackbone())
            self.score = head
            self.config = clf.config

    model = OneColumnReward().eval()
    model.requires_grad_(False)
    return model


def build_value_model(policy_path: str):
    """TRL's standard critic: a 1-label sequence classifier on the policy backbone; head zeroed like ours."""
    from transformers import AutoModelForSequenceClassification

    value = AutoModelForSequenceClassification.from_pretrained(
        policy_path, num_labels=1, local_files_only=True
    )
    with torch.no_grad():
        value.score.weight.zero_()
        if getattr(value.score, "bias", None) is not None:
            value.score.bias.zero_()
    return value


def left_pad(rows: list[list[int]], pad_id: int):
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
    return out


def right_pad(rows: list[list[int]], pad_id: int):
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


# ----------------------------------------------------------------------------- verify


def verify_reward(args: argparse.Namespace) -> dict[str, Any]:
    """Max |TRL get_reward - this project's score| over samples scored by this project."""
    from transformers import AutoTokenizer
    from trl.experimental.utils import get_reward

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.policy, local_files_only=True)
    data = json.loads(Path(args.samples).read_text())
    model = build_reward_model(args.reward, tok.eos_token_id, args.positive_label)
    queries = left_pad(data["prompts"], tok.pad_token_id)
    responses = right_pad(data["responses"], tok.pad_token_id)
    with torch.no_grad():
        _, scores, _ = get_reward(
            model, torch.cat([queries, responses], 1), tok.pad_token_id, queries.shape[1]
        )
    ours = torch.tensor(data["scores"], dtype=torch.float32)
    diff = (scores.float() - ours).abs()
    return {"samples": len(ours), "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}


# ----------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from datasets import Dataset
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorWithPadding,
        TrainerCallback,
        set_seed,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    marks = {"imported": time.time()}
    set_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.policy, local_files_only=True)
    tok.padding_side = "left"  # TRL generates from left-padded queries
    order = json.loads(Path(args.prompts).read_text())["input_ids"]
    batch = args.batch_size
    if len(order) < args.steps * batch:
        raise ValueError(f"{args.prompts}: {len(order)} prompts, need steps x batch = {args.steps * batch}")
    dataset = Dataset.from_dict({"input_ids": order[: args.steps * batch]})

    policy = AutoModelForCausalLM.from_pretrained(args.policy, local_files_only=True)
    value = build_value_model(args.policy)
    reward = build_reward_model(args.reward, tok.eos_token_id, args.positive_label)
    config = PPOConfig(
        output_dir=args.output_dir,
        report_to=[],
        push_to_hub=False,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=args.seed,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_betas[0],
        adam_beta2=args.adam_betas[1],
        adam_epsilon=args.adam_eps,
        # TRL's rollout batch is per_device_train_batch_size x gradient_accumulation_steps; its
        # minibatches split that, and each micro-batch of a minibatch is one optimizer step when
        # gradient_accumulation_steps=1. So 64 / 2 minibatches = 2 optimizer steps of 32 per epoch.
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_mini_batches=args.num_minibatches,
        local_rollout_forward_batch_size=batch,
        total_episodes=args.steps * batch,
        num_ppo_epochs=args.ppo_epochs,
        response_length=args.response_length,
        temperature=args.temperature,
        stop_token="eos",
        missing_eos_penalty=None,
        whiten_rewards=False,
        kl_coef=args.kl_coef,
        kl_estimator=args.kl_estimator,
        cliprange=args.cliprange,
        cliprange_value=args.cliprange_value,
        vf_coef=args.vf_coef,
        gamma=args.gamma,
        lam=args.lam,
        num_sample_generations=0,
        dataloader_num_workers=0,
    )

    steps: list[dict[str, float]] = []
    pending: dict[str, list] = {"scores": [], "lengths": []}
    original_get_reward = ppo_module.get_reward

    def observed_get_reward(model, query_responses, pad_token_id, context_length):
        """TRL's get_reward unchanged; reward-model calls also record scores and response lengths."""
        out = original_get_reward(model, query_responses, pad_token_id, context_length)
        if model is reward:
            pending["scores"].extend(out[1].float().tolist())
            resp = query_responses[:, context_length:]
            pending["lengths"].extend(((resp != pad_token_id).sum(1)).tolist())
        return out

    ppo_module.get_reward = observed_get_reward

    class StepRecorder(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            scores, lengths = pending["scores"], pending["lengths"]
            pending["scores"], pending["lengths"] = [], []
            probs = torch.sigmoid(torch.tensor(scores, dtype=torch.float64))  # P(positive)
            steps.append(
                {
                    "step": len(steps) + 1,
                    "t": time.time(),  # wall clock: the caller subtracts its launch time
                    "samples": len(scores),
                    "tokens": int(sum(lengths)),
                    "reward_mean": sum(scores) / max(len(scores), 1),
                    "reward_prob_mean": float(probs.mean()) if scores else float("nan"),
                    "kl": float((logs or {}).get("objective/kl", float("nan"))),
                }
            )

    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=None,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        data_collator=DataCollatorWithPadding(tok),
        callbacks=[StepRecorder()],
    )
    # Same prompts in the same order as this project: TRL's own loader shuffles (shuffle=True).
    trainer.dataloader = DataLoader(
        dataset,
        batch_size=batch,
        shuffle=False,
        collate_fn=DataCollatorWithPadding(tok),
        drop_last=True,
    )
    marks["ready"] = time.time()
    trainer.train()
    return {
        "side": "trl",
        "steps": steps,
        "marks": marks,  # wall clock: the caller subtracts its launch time
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "threads": torch.get_num_threads(),
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
        "value_params": sum(p.numel() for p in value.parameters()),
        "policy_params": sum(p.numel() for p in policy.parameters()),
    }


def plot(args: argparse.Namespace) -> dict[str, Any]:
    """P(positive) and KL per step, and P(positive) against wall-clock seconds, of every side in the CSV."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(Path(args.csv).read_text().splitlines()))
    sides = [c[: -len("_kl")] for c in rows[0] if c.endswith("_kl")]
    names = {"this": "this project", "trl": "TRL PPOTrainer"}
    panels = [
        ("step", "p_positive", "mean P(positive)"),
        ("step", "kl", "KL to reference (k1, per sequence)"),
    ]
    panels.append(("t_s", "p_positive", "mean P(positive)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (x, y, ylabel) in zip(axes, panels, strict=True):
        for side in sides:
            xs = [float(r["step"] if x == "step" else r[f"{side}_{x}"]) for r in rows if r[f"{side}_{y}"]]
            ax.plot(
                xs, [float(r[f"{side}_{y}"]) for r in rows if r[f"{side}_{y}"]], label=names.get(side, side)
            )
        ax.set(xlabel="PPO step" if x == "step" else "seconds since launch", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    return {"png": str(args.png)}


# ----------------------------------------------------------------------------- CLI


def _pair(text: str) -> tuple[float, float]:
    a, b = (float(x) for x in text.split(","))
    return a, b


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="trl_runner.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--policy", required=True, help="policy folder (save_pretrained)")
        p.add_argument("--reward", required=True, help="2-label sentiment classifier folder")
        p.add_argument("--positive-label", type=int, default=1)
        p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
        p.add_argument("--out", default=None, help="write the JSON result here (else stdout)")

    r = sub.add_parser("run", help="train with TRL's PPOTrainer and record per-step rewards")
    common(r)
    r.add_argument("--prompts", required=True, help='JSON {"input_ids": [[...], ...]} in training order')
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--batch-size", type=int, default=64, help="samples per PPO step (rollout batch)")
    r.add_argument("--num-minibatches", type=int, default=2)
    r.add_argument("--ppo-epochs", type=int, default=2)
    r.add_argument("--response-length", type=int, default=24)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--lr", type=float, default=2e-4)
    r.add_argument("--adam-betas", type=_pair, default=(0.9, 0.999), help="beta1,beta2")
    r.add_argument("--adam-eps", type=float, default=1e-8)
    r.add_argument("--weight-decay", type=float, default=0.0)
    r.add_argument("--kl-coef", type=float, default=0.2)
    r.add_argument("--kl-estimator", choices=["k1", "k3"], default="k1")
    r.add_argument("--cliprange", type=float, default=0.2)
    r.add_argument("--cliprange-value", type=float, default=0.2)
    r.add_argument("--vf-coef", type=float, default=0.1)
    r.add_argument("--gamma", type=float, default=1.0)
    r.add_argument("--lam", type=float, default=0.95)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--output-dir", default="/tmp/trl-ppo-bench", help="TRL's output_dir (nothing is saved)")

    v = sub.add_parser("verify-reward", help="check TRL's reward equals this project's on given samples")
    common(v)
    v.add_argument("--samples", required=True, help='JSON {"prompts", "responses", "scores"}')
    pl = sub.add_parser("plot", help="draw the reward/KL curves CSV written by compare_trl.py as a PNG")
    pl.add_argument("--csv", required=True)
    pl.add_argument("--png", required=True)
    pl.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "run" and args.batch_size % args.num_minibatches:
        ap.error(
            f"--batch-size {args.batch_size} is not a multiple of --num-minibatches {args.num_minibatches}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = {"run": run, "verify-reward": verify_reward, "plot": plot}[args.cmd](args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
