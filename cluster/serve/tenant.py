"""One tenant's training model: a LoRA adapter (PEFT, `learner.lora`) on the learner's own model class
(`learner.model.PolicyWithValueHead`, loaded as a learner rank loads it), its AdamW state, and the
Tinker calls on it: `forward_backward` (gradients accumulate until `optim_step`) and `optim_step`
(AdamW with the request's hyperparameters). A plain class; `cluster.serve.service` hosts each tenant
in a Ray actor of its own.

Scoring follows Tinker's alignment: input position t scores `target_tokens[t]`, i.e. the learner's
response layout with a prompt of length 1 and a response of N tokens (`kernel.sequences`), so
`PolicyWithValueHead.forward(..., targets=...)` gives lp_t. A batch is right-padded; pad positions
are masked out of every loss and never change a valid position (causal attention).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cluster.serve.losses import LossBatch, lookup
from cluster.serve.wire import WireDatum
from learner.config_blocks import LoRAConfig
from learner.lora import adapter_bundle
from learner.model import PolicyWithValueHead

BUCKET_BYTES = 1 << 26  # the export's gather bucket (learner.gather; one process, so no ZeRO gathers)


@dataclasses.dataclass(frozen=True)
class AdamStep:
    """Tinker's `AdamParams` (its defaults): AdamW, decoupled weight decay, global-norm clip (0 = off)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepOutput:
    outputs: list[dict[str, np.ndarray]]  # per datum: logprobs (+ the loss's extras), each [N_i]
    metrics: dict[str, float]  # `<name>:<reduction>` as the SDK reduces across chunks


def _padded(rows: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(np.asarray(r).reshape(-1), dtype=dtype)
    return out


class TenantModel:
    def __init__(self, base_path: str, lora: LoRAConfig, seed: int, torch_threads: int = 1) -> None:
        torch.set_num_threads(torch_threads)
        self.model = PolicyWithValueHead.from_pretrained(base_path, lora=lora, seed=seed)
        self.model.value_head.requires_grad_(False)  # no critic: Tinker trains the policy only
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: torch.optim.AdamW | None = None
        self.steps = 0

    def _scores(self, data: list[WireDatum]) -> tuple[torch.Tensor, torch.Tensor]:
        """(lp [B, T] of each datum's target_tokens, mask [B, T])."""
        for i, d in enumerate(data):
            if "target_tokens" not in d.inputs:
                raise ValueError(f"datum {i}: loss_fn_inputs needs 'target_tokens'")
            if d.inputs["target_tokens"].reshape(-1).shape[0] != len(d.tokens):
                raise ValueError(
                    f"datum {i}: target_tokens has {d.inputs['target_tokens'].size} entries for "
                    f"{len(d.tokens)} input tokens (one target per input position)"
                )
        lengths = torch.tensor([len(d.tokens) for d in data])
        ids = _padded([d.tokens for d in data], torch.long)
        targets = _padded([d.inputs["target_tokens"] for d in data], torch.long)
        mask = (torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float32)
        scores = self.model(
            ids, mask.to(torch.long), torch.ones(len(data), dtype=torch.long), ids.shape[1], targets=targets
        )
        return scores.logprobs, mask

    def forward_backward(
        self, data: list[WireDatum], loss_fn: str, config: dict, forward_only: bool
    ) -> StepOutput:
        if not data:
            raise ValueError("forward_backward got no data")
        first = set(data[0].inputs)
        for i, d in enumerate(data):
            if set(d.inputs) != first:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs {sorted(d.inputs)} differ from datum 0's {sorted(first)} (every "
                    "datum of one call sends the same inputs)"
                )
            for k, v in d.inputs.items():
                if np.asarray(v).size != len(d.tokens):
                    raise ValueError(
                        f"datum {i}: loss_fn_inputs[{k!r}] has {np.asarray(v).size} entries for "
                        f"{len(d.tokens)} tokens"
                    )
        names = first - {"target_tokens"}
        loss = lookup(loss_fn, names, config)
        with torch.set_grad_enabled(not forward_only):
            lp, mask = self._scores(data)
            inputs = {k: _padded([d.inputs[k] for d in data], torch.float32) for k in names}
            result = loss(LossBatch(lp, inputs, mask), config)
        if not forward_only:
            result.loss.backward()
        outputs = []
        for i, d in enumerate(data):
            n = len(d.tokens)
            row = {"logprobs": lp[i, :n].detach().float().numpy()}
            row |= {k: v[i, :n].float().numpy() for k, v in result.extra.items()}
            outputs.append(row)
        return StepOutput(outputs, {"loss:sum": float(result.loss.detach())})

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One AdamW step on the accumulated gradients, then zero them."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=step.learning_rate)
        for group in self.optimizer.param_groups:
            group.update(
                lr=step.learning_rate,
                betas=(step.beta1, step.beta2),
                eps=step.eps,
                weight_decay=step.weight_decay,
            )
        norm = torch.nn.utils.clip_grad_norm_(
            self.params, step.grad_clip_norm if step.grad_clip_norm > 0 else float("inf")
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": float(norm), "step:max": float(self.steps)}

    def training_state(self) -> dict:
        """What `save_state` keeps: the trainable (adapter) tensors by name, the AdamW state (None before
        the first step: a fresh AdamW is that state) and the step count; CPU copies."""
        adapter = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        optimizer = None if self.optimizer is None else self.optimizer.state_dict()
        return {"adapter": adapter, "optimizer": optimizer, "steps": self.steps}

    def load_training_state(self, state: dict, with_optimizer: bool) -> float:
        """Set the adapter to a `training_state` (bit for bit); with_optimizer: its AdamW state and step
        count too, else a fresh AdamW (Tinker's `load_state`: the optimizer resets). Pending gradients are
        dropped. The adapter digest after."""
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(state["adapter"]) != set(named):
            missing, extra = (
                sorted(set(named) - set(state["adapter"])),
                sorted(set(state["adapter"]) - set(named)),
            )
            raise ValueError(
                f"the checkpoint's adapter does not fit this model: missing {missing}, extra {extra}"
            )
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(state["adapter"][n])
                p.grad = None
        self.optimizer, self.steps = None, 0
        if with_optimizer and state["optimizer"] is not None:
            self.optimizer = torch.optim.AdamW(self.params)
            self.optimizer.load_state_dict(state["optimizer"])
            self.steps = int(state["steps"])
        return self.adapter_digest()

    def adapter_bundle(self) -> dict[str, torch.Tensor]:
        """The adapter as a rollout engine applies it (`learner.lora.adapter_bundle`: alpha/r folded into
        B, the base model's module names), float32 CPU copies."""
        return adapter_bundle(self.model.policy, BUCKET_BYTES, keep=True, dtype=torch.float32)

    def adapter_digest(self) -> float:
        """The sum of |w| over the trainable (adapter) weights: a cheap witness that a step moved them."""
        return float(sum(p.detach().abs().sum() for p in self.params))
