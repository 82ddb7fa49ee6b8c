"""Run in its own process by tests/test_tinker_learner_step.py (a torch.distributed world of one rank
stays in the process that makes it): one batch trained two steps by (a) the project's learner
(`LearnerRank.train_step`) and (b) a Tinker tenant (`cluster.serve.tenant.TenantModel`:
forward_backward, optim_step), both from the same base model and LoRA seed; prints a JSON report.

    python -m tests.tinker_learner_step MODEL_DIR LOSS STAGE  # importance_sampling | ppo; ZeRO 2 | 3

The learner's config is the Tinker loss's: policy_loss 'ppo' (importance_sampling: clip.eps 1e9, a
clip no ratio reaches, the learner's log-ratio clamp at +-20 keeps it below 1 + 1e9), proximal_pass
'bypass' (the old logprobs are the batch's sampler logprobs, Tinker's `logprobs` input), no KL, no
entropy, no critic (grpo), one epoch of one minibatch in one micro-batch, the same AdamW
hyperparameters and clip. Normalisation: the learner's 'seq-mean-token-sum' is the token sum / B (B
sequences); Tinker's loss is the token sum, so the tenant gets the learner's advantages / B (both
losses are linear in A, so the gradients are the same numbers). Tinker's first step arrives as two
forward_backward calls (two halves of the batch: DeepSpeed's accumulation), its second as one.

Then a save/load witness on the same engines: a second tenant (another LoRA seed) with a
forward_backward pending loads the first's state with its optimizer (the pending gradients must be
dropped); one more identical step on both must give the same adapter, bit for bit.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from cluster.serve.tenant import AdamStep, TenantModel
from cluster.serve.wire import WireDatum
from learner.batch import pack_trajectories
from learner.config import KLConfig, LearnerConfig, LoRAConfig
from learner.context import LearnerContext
from learner.deepspeed_setup import free_port
from learner.gather import cpu_state_dict
from learner.prepare import prepare
from learner.rank import LearnerRank
from learner.trajectory import Trajectory

LORA = LoRAConfig(rank=4, alpha=8.0)
ADAM = AdamStep(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.01, grad_clip_norm=0.5)
SEED, STEPS = 3, 2


def learner_config(loss: str, stage: int) -> LearnerConfig:
    return LearnerConfig(
        lora=LORA,
        zero_stage=stage,
        advantage="grpo",
        policy_loss="ppo",
        clip={"eps": {"importance_sampling": 1e9, "ppo": 0.2}[loss]},
        loss_agg="seq-mean-token-sum",
        proximal_pass="bypass",
        kl=KLConfig(coef=0.0),
        entropy_coef=0.0,
        ppo_epochs=1,
        num_minibatches=1,
        micro_batch_size=64,
        lr=ADAM.learning_rate,
        adam_betas=(ADAM.beta1, ADAM.beta2),
        adam_eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
        max_grad_norm=ADAM.grad_clip_norm,
        warmup_steps=0,
    )


def trajectories(vocab: int) -> list[Trajectory]:
    """Six samples in two groups of three, sampler logprobs spread around -log(vocab) so that some
    ratios leave PPO's [0.8, 1.2]."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(6):
        p, r = 2 + i % 3, 3 + (i * 2) % 5
        behaviour = (-np.log(vocab) + rng.normal(0.0, 0.4, r)).astype(np.float32)
        out.append(
            Trajectory(
                prompt_ids=rng.integers(3, vocab, p).astype(np.int64),
                response_ids=rng.integers(3, vocab, r).astype(np.int64),
                behaviour_logprobs=behaviour,
                ref_logprobs=behaviour.copy(),  # read by the KL terms, whose coefficient is 0
                score=float(rng.normal()),
                group=i // 3,
            )
        )
    return out


def tinker_data(trajs: list[Trajectory], advantages: torch.Tensor) -> list[WireDatum]:
    """Tinker's layout of each trajectory: tokens = (prompt + response)[:-1], targets shifted by one;
    the sampler logprobs and advantages (/ B) on the response's positions, 0 on the prompt's."""
    data = []
    for i, t in enumerate(trajs):
        seq = np.concatenate([t.prompt_ids, t.response_ids])
        pad = len(t.prompt_ids) - 1
        r = len(t.response_ids)
        adv = advantages[i, :r].double().numpy() / len(trajs)
        inputs = {
            "target_tokens": seq[1:],
            "logprobs": np.concatenate([np.zeros(pad), t.behaviour_logprobs]).astype(np.float32),
            "advantages": np.concatenate([np.zeros(pad), adv]).astype(np.float32),
        }
        data.append(WireDatum(tokens=seq[:-1], inputs=inputs))
    return data


def adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors, CPU copies (gathered under ZeRO-3)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return cpu_state_dict(trainable, 1 << 26, keep=True)


def main(model_dir: str, loss: str, stage: int) -> dict:
    config = learner_config(loss, stage)
    rank = LearnerRank(0, 1, model_dir, config, seed=SEED, pad_token_id=0, temperature=1.0)
    rank.setup("127.0.0.1", free_port())
    vocab = rank.engine.module.policy.config.get_text_config().vocab_size
    trajs = trajectories(vocab)
    batch = pack_trajectories(trajs, 0)
    prepare(LearnerContext(rank.engine, config, 1.0, 0), batch, 0.0, bypass=True)
    advantages = batch.tokens.advantages * batch.mask
    start = adapter(rank.engine.module)
    learner = [rank.train_step(trajs) for _ in range(STEPS)]
    tenant = TenantModel(model_dir, LORA, SEED, zero_stage=stage)
    same_start = max(float((adapter(tenant.model)[n] - w).abs().max()) for n, w in start.items())
    data = tinker_data(trajs, advantages)
    tinker = []
    for step in range(STEPS):
        for part in (data[:3], data[3:]) if step == 0 else (data,):
            tenant.forward_backward(part, loss, {}, forward_only=False)
        tinker.append(tenant.optim_step(ADAM))
    a, b = adapter(rank.engine.module), adapter(tenant.model)
    other = TenantModel(model_dir, LORA, SEED + 1, zero_stage=stage)
    other.forward_backward(data, loss, {}, forward_only=False)  # pending: the load drops it
    other.load_training_state(tenant.training_state(), with_optimizer=True)
    for t in (tenant, other):
        t.forward_backward(data, loss, {}, forward_only=False)
        t.optim_step(ADAM)
    c, d = adapter(tenant.model), adapter(other.model)
    return {
        "resumed_diff": max(float((c[n] - d[n]).abs().max()) for n in c),
        "resumed_moved": max(float((c[n] - b[n]).abs().max()) for n in c),
        "resumed_steps": [tenant.steps, other.steps],
        "optimizer": type(tenant.engine.optimizer).__name__,
        "same_start": same_start,
        "moved": max(float((a[n] - start[n]).abs().max()) for n in a),
        "max_diff": max(float((a[n] - b[n]).abs().max()) for n in a),
        "names": sorted(a) == sorted(b),
        "learner_grad_norms": [m["params/grad_norm"] for m in learner],
        "tinker_grad_norms": [m["grad_norm:mean"] for m in tinker],
        "learner_steps": [m["train/optimizer_steps"] for m in learner],
        "clip_frac": [m["params/policy_clip_frac"] for m in learner],
        "nonzero_advantages": int((advantages != 0).sum()),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
