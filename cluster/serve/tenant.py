"""One tenant's training model: a LoRA adapter (PEFT, `learner.lora`) on the learner's own model class,
trained by the learner's own DeepSpeed engine (`learner.deepspeed_setup.single_process_engine`: the
learner's `initialize_engine`, its AdamW and ZeRO stage, gloo on CPU, in a one-rank world of this
process), and the Tinker calls on it. A plain class; `cluster.serve.service` hosts each tenant in a Ray
actor (a process) of its own.

- `forward_backward`: `engine.backward` of the loss, off the accumulation boundary, so gradients add up
  over calls (Tinker's semantics: several calls then one step train on their sum).
- `optim_step`: the window is closed the learner's way (a zero-weight dummy micro-batch at the
  boundary, `learner.forward.anchored_backward`: the sum is unchanged), the request's `AdamParams` are
  set on the optimizer's parameter groups (lr, betas, eps, weight decay) and on ZeRO's clip
  (`grad_clip_norm`, 0 = off, DeepSpeed's clip formula), then `engine.step()`.
- Dropping pending gradients (a load between a `forward_backward` and its step) goes through DeepSpeed's
  overflow path: a NaN-weighted dummy at the boundary, and the skipped step clears them.

Scoring follows Tinker's alignment: input position t scores `target_tokens[t]`, i.e. the learner's
response layout with a prompt of length 1 and a response of N tokens (`kernel.sequences`), so
`PolicyWithValueHead.forward(..., targets=...)` gives lp_t. A batch is right-padded; pad positions
are masked out of every loss and never change a valid position (causal attention).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import defaultdict

import numpy as np
import torch

from cluster.serve.losses import LossBatch, lookup
from cluster.serve.wire import WireDatum
from learner.batch import dummy_batch
from learner.config import LearnerConfig, LoRAConfig
from learner.deepspeed_setup import single_process_engine
from learner.forward import anchored_backward, forward_scores
from learner.gather import cpu_state_dict
from learner.lora import adapter_bundle
from learner.model import PolicyWithValueHead, learner_policy

BUCKET_BYTES = 1 << 26  # the gather bucket of the adapter's copies (learner.gather: ZeRO-3 gathers)


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


def tenant_config(lora: LoRAConfig, torch_threads: int = 1, zero_stage: int = 2) -> LearnerConfig:
    """The learner config a tenant's engine is built from: the learner's defaults (float32, AdamW: its
    lr, betas, eps, weight decay and clip are each `optim_step`'s) with the serve config's LoRA, threads
    and ZeRO stage (2 or 3, checked by `LearnerConfig`)."""
    return LearnerConfig(lora=lora, torch_threads=torch_threads, zero_stage=zero_stage)


class TenantModel:
    """Built in two steps, each a method so that a warm pool actor (`cluster.serve.pool`) runs the first
    before any request: `load_base` (the imports are done by then; threads set, the base model's HF
    policy loaded) and `attach` (the LoRA adapter drawn from `seed`, the value head, the DeepSpeed
    engine). `TenantModel(base_path, lora, seed, ...)` runs both (a cold start); with `lora=None` only
    the first (a pool actor waiting for its request). Either way the same calls in the same order."""

    def __init__(
        self,
        base_path: str,
        lora: LoRAConfig | None,
        seed: int = 0,
        torch_threads: int = 1,
        zero_stage: int = 2,
    ) -> None:
        self.load_base(base_path, torch_threads, zero_stage)
        if lora is not None:
            self.attach(lora, seed)

    def load_base(self, base_path: str, torch_threads: int, zero_stage: int) -> None:
        self.base_path, self.torch_threads, self.zero_stage = base_path, torch_threads, zero_stage
        torch.set_num_threads(torch_threads)
        # the policy's load fields (dtype, checkpointing, attention) do not depend on the adapter
        self.base = learner_policy(base_path, tenant_config(LoRAConfig(), torch_threads, zero_stage))
        self.engine = None

    def attach(self, lora: LoRAConfig, seed: int) -> float:
        """The adapter (LoRA init `seed`) on the loaded base and the engine around it, once; the adapter
        digest."""
        if self.engine is not None:
            raise RuntimeError("this tenant has its adapter already (a pool actor serves one request)")
        self.config = tenant_config(lora, self.torch_threads, self.zero_stage)
        self.model = PolicyWithValueHead.for_learner(self.base_path, self.config, seed, policy=self.base)
        self.base = None  # the model holds it now (with its adapters)
        self.model.value_head.requires_grad_(False)  # no critic: Tinker trains the policy only
        self.engine = single_process_engine(self.model, self.config)
        self.steps = 0
        self.pending = False  # gradients accumulated since the last step
        return self.adapter_digest()

    def loaded(self) -> str:
        """The base model's path once `load_base` ran (a pool actor's readiness)."""
        return self.base_path

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
        device = self.engine.device
        ids, targets, mask = ids.to(device), targets.to(device), mask.to(device)
        ones = torch.ones(len(data), dtype=torch.long, device=device)
        scores = self.engine(ids, mask.to(torch.long), ones, ids.shape[1], targets=targets)
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
            inputs = {k: _padded([d.inputs[k] for d in data], torch.float32).to(lp.device) for k in names}
            result = loss(LossBatch(lp, inputs, mask), config)
        if not forward_only:
            self.engine.set_gradient_accumulation_boundary(False)
            self.engine.backward(result.loss, scale_wrt_gas=False)
            self.pending = True
        outputs = []
        for i, d in enumerate(data):
            n = len(d.tokens)
            row = {"logprobs": lp[i, :n].detach().float().cpu().numpy()}
            row |= {k: v[i, :n].float().cpu().numpy() for k, v in result.extra.items()}
            outputs.append(row)
        return StepOutput(outputs, {"loss:sum": float(result.loss.detach())})

    def _close_window(self, scale: float) -> None:
        """A dummy micro-batch weighted `scale` at the accumulation boundary (`anchored_backward`)."""
        self.engine.set_gradient_accumulation_boundary(True)
        scored = forward_scores(self.engine, dummy_batch(0).to(self.engine.device), 1.0)
        anchored_backward(self.engine, scored, scale, critic=False)

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One step of the engine's AdamW on the gradients accumulated since the last, with `step`'s
        hyperparameters."""
        self._close_window(0.0)
        with self._adam() as adam:
            for group in adam.param_groups:
                group.update(
                    lr=step.learning_rate,
                    betas=(step.beta1, step.beta2),
                    eps=step.eps,
                    weight_decay=step.weight_decay,
                )
        self.engine.optimizer.clip_grad = step.grad_clip_norm  # ZeRO's clip; 0 = off
        self.engine.step()
        if not self.engine.was_step_applied():
            raise RuntimeError("optim_step: the gradient norm is not finite; the step was skipped")
        self.pending = False
        self.steps += 1
        norm = float(self.engine.get_global_grad_norm() or 0.0)
        return {"grad_norm:mean": norm, "step:max": float(self.steps)}

    @contextlib.contextmanager
    def _adam(self):
        """The torch AdamW the ZeRO optimizer steps, over its flat fp32 partitions. ZeRO-3 hands it
        those partitions only around a step; here too (`_set/_clear_fp32_optimizer_param_groups`, as
        ZeRO-3's own `state_dict` does), so its state maps onto them."""
        zero = self.engine.optimizer
        lend = hasattr(zero, "_set_fp32_optimizer_param_groups")
        if lend:
            zero._set_fp32_optimizer_param_groups()
        try:
            yield zero.optimizer
        finally:
            if lend:
                zero._clear_fp32_optimizer_param_groups()

    def training_state(self) -> dict:
        """What `save_state` keeps: the trainable (adapter) tensors by name, the AdamW state (None before
        the first step: a fresh AdamW is that state) and the step count; CPU copies."""
        adapter = self._adapter()
        optimizer = None
        if self.steps:
            with self._adam() as adam:
                optimizer = copy.deepcopy(adam.state_dict())
        return {"adapter": adapter, "optimizer": optimizer, "steps": self.steps}

    def load_training_state(self, state: dict, with_optimizer: bool) -> float:
        """Set the adapter to a `training_state` (bit for bit: the model's weights and ZeRO's fp32 master
        copy); with_optimizer: its AdamW state and step count too, else a fresh AdamW (Tinker's
        `load_state`: the optimizer resets). Pending gradients are dropped. The adapter digest after."""
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(state["adapter"]) != set(named):
            missing, extra = (
                sorted(set(named) - set(state["adapter"])),
                sorted(set(state["adapter"]) - set(named)),
            )
            raise ValueError(
                f"the checkpoint's adapter does not fit this model: missing {missing}, extra {extra}"
            )
        if self.pending:
            self._close_window(float("nan"))
            self.engine.step()  # skipped (DeepSpeed's overflow path): the gradients are gone
            self.pending = False
        with torch.no_grad(), _modifying(list(named.values())):
            for n, p in named.items():
                p.copy_(state["adapter"][n])
        self.engine.optimizer.refresh_fp32_params()  # ZeRO's fp32 master copy from the model's weights
        self.steps = 0
        with self._adam() as adam:
            adam.state = defaultdict(dict)  # torch's AdamW starts a parameter's state at its first step
            if with_optimizer and state["optimizer"] is not None:
                adam.load_state_dict(state["optimizer"])
                self.steps = int(state["steps"])
        return self.adapter_digest()

    def adapter_bundle(self) -> dict[str, torch.Tensor]:
        """The adapter as a rollout engine applies it (`learner.lora.adapter_bundle`: alpha/r folded into
        B, the base model's module names), float32 CPU copies."""
        return adapter_bundle(self.model.policy, BUCKET_BYTES, keep=True, dtype=torch.float32)

    def adapter_digest(self) -> float:
        """The sum of |w| over the trainable (adapter) weights: a cheap witness that a step moved them."""
        return float(sum(t.abs().sum() for t in self._adapter().values()))

    def _adapter(self) -> dict[str, torch.Tensor]:
        """The trainable (adapter) tensors by name: CPU copies, gathered under ZeRO-3."""
        trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        return cpu_state_dict(trainable, BUCKET_BYTES, keep=True)


def _modifying(params: list[torch.nn.Parameter]):
    """Under ZeRO-3, the full parameters for the block, their changes partitioned back at its end (rank 0's:
    the only rank); anything else as it is."""
    zero3 = [p for p in params if hasattr(p, "ds_id")]
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(zero3, modifier_rank=0)
