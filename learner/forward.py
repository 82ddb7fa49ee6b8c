"""What both phases of a PPO step (`learner.prepare`, then `learner.ppo_step`) run on a rank's shard: the
forward that scores response tokens, the cut of rows into micro-batches it runs in, and the float64
all_reduce through which the ranks agree on counts and sums."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from kernel.moe_routing import NOT_RECORDED, replay_routing
from kernel.sequences import pack_rows, response_tokens
from learner.batch import Batch
from learner.config import LearnerConfig
from learner.micro_batches import plan_micro_batches


def world_size() -> int:
    """Ranks in the learner world (1 in a single process without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(values: Sequence[float] | torch.Tensor, op: str = "sum", device="cpu") -> torch.Tensor:
    """float64 all_reduce over the learner world (a no-op in a single process without a world)."""
    if isinstance(values, torch.Tensor):
        t = values.detach().to(device=device, dtype=torch.float64).clone()
    else:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu()


class RankSums:
    """Base of a dataclass of float sums the ranks add up: its fields in declaration order are the one
    place where names meet the vector that travels through `all_reduce`."""

    def add(self, other: RankSums) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [float(getattr(self, f.name)) for f in dataclasses.fields(self)], dtype=torch.float64
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor):
        return cls(**{f.name: float(v) for f, v in zip(dataclasses.fields(cls), t.tolist(), strict=True)})

    def all_reduced(self, device):
        """The sums over all ranks (a collective: every rank calls it)."""
        return type(self).from_tensor(all_reduce(self.as_tensor(), "sum", device))


class Scored(NamedTuple):
    """What one forward gives the PPO loss, in the padded `[B, R]` layout of the micro-batch."""

    logprobs: torch.Tensor  # float32 log-probabilities of the response tokens
    values: torch.Tensor  # float32 values
    entropy: torch.Tensor | None  # per-token entropy (with grad), only when asked for

    @property
    def anchor(self) -> torch.Tensor:
        """Sum of the logprobs (and entropies, where computed): backward(anchor * 0) reaches every policy
        parameter, since d logp / d z = onehot - softmax(z) is dense over the vocabulary (0 or NaN
        everywhere: only zero-weight and poisoned micro-batches need it). It reads exactly the policy
        outputs a real micro-batch's loss reads (a zero-weight forward asks for entropy as the real ones
        do): ZeRO-3 fetches a module's parameters once per output its backward passes through, so ranks
        whose backward passes through different outputs make different collectives and deadlock."""
        return self.logprobs.sum() + (self.entropy.sum() if self.entropy is not None else 0.0)


def replays_routing(config: LearnerConfig, batch: Batch, proximal: bool = False) -> bool:
    """Whether the forwards on `batch` replay its routing: learner.router_replay 'R3' (the engine's) in every
    pass, 'R2' (the proximal pass's own, `keep_routing`) in the passes after the proximal one. R3 on a shard
    whose trajectories carry no routing is a ValueError naming the fields."""
    if config.router_replay == "R2":
        if not proximal and len(batch) and batch.routing is None:
            raise ValueError(
                "learner.router_replay='R2' replays the proximal pass's routing, but this shard has none (no "
                "proximal pass ran: learner.bypass skips it); use 'R3' or 'none'"
            )
        return not proximal
    if config.router_replay != "R3":
        return False
    if len(batch) and batch.routing is None:
        raise ValueError(
            "learner.router_replay='R3' replays the engine's recorded routing, but the trajectories carry none: "
            "set rollout.record_routing: true (rollout.engine 'hf', a mixture-of-experts policy)"
        )
    return True


def keep_routing(
    shard: torch.Tensor, rows: torch.Tensor, mb: Batch, taken: list[list[torch.Tensor]], packed: bool
) -> torch.Tensor:
    """learner.router_replay 'R2': the routing one forward of micro-batch `mb` (rows `rows` of the shard)
    recorded (`kernel.moe_routing.record_routing`, padded or packed layout) written into the shard's
    `[B, L, layers, k]` routing (NOT_RECORDED where nothing real was routed)."""
    layers = torch.stack([t[0] for t in taken], dim=1).cpu()  # [N, layers, k]
    if layers.dtype != torch.uint8:
        raise ValueError("learner.router_replay='R2' keeps routing in uint8: at most 254 experts per layer")
    real = mb.attention_mask.bool().cpu()
    block = torch.full((*real.shape, *layers.shape[1:]), NOT_RECORDED, dtype=torch.uint8)
    block[real] = layers if packed else layers.view(*real.shape, *layers.shape[1:])[real]
    shard[rows, : block.shape[1]] = block
    return shard


def forward_scores(
    model,
    b: Batch,
    temperature: float,
    extra: int = 0,
    packed: bool = False,
    entropy: bool = False,
    replay: bool = False,
) -> Scored:
    """Log-probabilities and values (and entropies with `entropy`) of the response tokens of `b`.

    With `extra=1` every output has R+1 positions: position `len_i` of row i then holds what the
    state after its last token gives (the value a truncated response bootstraps from). `packed`: one
    padding-free row (`kernel.sequences.pack_rows`), outputs only at real response positions. The
    model scores the tokens itself (`PolicyWithValueHead.forward` with `targets`: from full logits, or
    chunked from the hidden states). `replay` (learner.router_replay 'R3'): the MoE layers route as
    `b.routing` says (`kernel.moe_routing.replay_routing`, laid out padded or packed); a batch without
    routing (the dummy batch of a rank with no data) routes itself."""
    routing = None
    if replay and b.routing is not None:
        routing = b.packed_routing() if packed else b.padded_routing()
    with replay_routing(model, routing) if routing is not None else contextlib.nullcontext():
        return _forward_scores(model, b, temperature, extra, packed, entropy)


def _forward_scores(model, b: Batch, temperature: float, extra: int, packed: bool, entropy: bool) -> Scored:
    R = b.mask.shape[1] + extra
    if packed:
        counts = b.response_lens + extra
        rows = pack_rows(b.input_ids.cpu(), b.attention_mask.cpu(), b.prompt_lens.cpu(), counts.cpu(), R)
        rows = rows.to(b.input_ids.device)
        s = model(None, None, None, R, temperature, packed=rows, targets=rows.targets, entropy=entropy)
        place = rows.unpack  # outputs back into the padded layout
    else:
        tokens = response_tokens(b.input_ids, b.prompt_lens, R)
        s = model(
            b.input_ids, b.attention_mask, b.prompt_lens, R, temperature, targets=tokens, entropy=entropy
        )
        place = _as_is
    ent = place(s.entropy) if entropy else None
    return Scored(place(s.logprobs), place(s.values.float()), ent)


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def micro_batch_rows(batch: Batch, idx: torch.Tensor, config: LearnerConfig) -> list[torch.Tensor]:
    """Rows `idx` of `batch` cut by count or under the token budget (`learner.micro_batches`)."""
    lengths = batch.attention_mask[idx].sum(1).tolist()
    plan = plan_micro_batches(
        lengths,
        max_rows=config.micro_batch_size,
        max_tokens=config.max_tokens_per_micro_batch,
        packed=config.pack_sequences,
    )
    return [idx[torch.tensor(members, dtype=torch.long)] for members in plan]


def anchored_backward(engine, scored: Scored, scale: float, critic: bool) -> None:
    """`engine.backward(scale x (the scored outputs' anchor, plus the values' sum with a critic))`:
    every parameter a real micro-batch reaches gets a gradient of 0 (`scale` 0) or NaN (`scale` NaN),
    through the same modules (the frozen value head only with a `critic`, or ZeRO-3 would gather it in
    this backward alone and the ranks' collectives differ). 0 on a dummy micro-batch
    (`learner.batch.dummy_batch`): a rank without data makes the same calls as the others, and an
    accumulation window closes at its boundary with its sum unchanged; NaN: DeepSpeed's overflow path
    skips the step on every rank and drops the accumulated gradients."""
    out = scored.anchor + (scored.values.sum() if critic else 0.0)
    engine.backward(out * scale, scale_wrt_gas=False)
