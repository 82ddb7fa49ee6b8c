"""The record the learner takes (one scored trajectory; `cluster` builds these from rollout samples)
and a rank's shard of them packed into right-padded tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from kernel.moe_routing import NOT_RECORDED
from kernel.sequences import pack_sequences
from learner.trajectory import Trajectory

__all__ = ["Batch", "TokenFields", "Trajectory", "dummy_batch", "pack_trajectories"]


@dataclass
class TokenFields:
    """A shard's per-token tensors, `[B, R]` over response tokens (None: not there). From the rollout:
    the behaviour and reference logprobs, and the earlier turns' rewards of multi-turn episodes. Filled by
    `learner.prepare` for the PPO epochs: the proximal logprobs and values, the advantages and returns,
    the off-policy weights (None when learner.off_policy is off) and the value clip radius (None unless
    learner.value_clip is 'relative')."""

    behaviour_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    value_clip: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenFields:
        """`fn` applied to every tensor that is there."""
        return TokenFields(**{f.name: _apply(fn, getattr(self, f.name)) for f in fields(self)})


def _apply(fn, x):
    return None if x is None else fn(x)


@dataclass
class Batch:
    """A rank's packed shard. Per-token fields are `[B, R]` over response tokens.

    `mask` is 1 on the response tokens the losses train (the policy's actions): every response token,
    except observation tokens of multi-turn episodes, so a row's mask may have gaps. A row's response
    length is `response_lens` (from the attention mask), never `mask.sum`."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lens: torch.Tensor
    mask: torch.Tensor
    scores: torch.Tensor
    tokens: TokenFields = field(default_factory=TokenFields)
    # Whole-shard facts read by `prepare` (not carried into micro-batches): group id per sequence
    # (equal ids = samples of one prompt) and whether it was cut at max_new_tokens.
    groups: torch.Tensor | None = None
    truncated: torch.Tensor | None = None
    # The engine's routing of an MoE policy (Trajectory.routing), aligned with `input_ids`:
    # [B, L, layers, k], NOT_RECORDED where nothing was recorded (padding, each row's last token).
    routing: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_lens(self) -> torch.Tensor:
        """[B] response tokens of each row (model and observation tokens alike)."""
        return self.attention_mask.sum(1).long() - self.prompt_lens

    def padded_routing(self) -> list[torch.Tensor]:
        """`routing` laid out as the padded forward of `input_ids` flattens its tokens: one [B*L, k]
        tensor per MoE layer (what `kernel.moe_routing.replay_routing` takes)."""
        if self.routing is None:
            raise ValueError("this batch carries no recorded routing")
        B, L, layers, k = self.routing.shape
        return [self.routing[:, :, i].reshape(B * L, k) for i in range(layers)]

    def packed_routing(self) -> list[torch.Tensor]:
        """`routing` laid out as the packed forward (`kernel.sequences.pack_rows`: the real tokens of the
        rows end to end) flattens its tokens: one [T, k] tensor per MoE layer."""
        if self.routing is None:
            raise ValueError("this batch carries no recorded routing")
        real = self.routing[self.attention_mask.bool()]  # [T, layers, k], row by row
        return [real[:, i] for i in range(real.shape[1])]

    def take(self, idx: torch.Tensor) -> Batch:
        """Rows `idx`, trimmed to their own longest sequence and response."""
        attn = self.attention_mask[idx]
        mask = self.mask[idx]
        L = max(int(attn.sum(1).max()), 2)
        R = max(int(self.response_lens[idx].max()), 1)
        return Batch(
            self.input_ids[idx, :L],
            attn[:, :L],
            self.prompt_lens[idx],
            mask[:, :R],
            self.scores[idx],
            self.tokens.map(lambda v: v[idx, :R]),
            routing=None if self.routing is None else self.routing[idx, :L],
        )

    def to(self, device) -> Batch:
        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.prompt_lens.to(device),
            self.mask.to(device),
            self.scores.to(device),
            self.tokens.map(lambda v: v.to(device)),
            routing=None if self.routing is None else self.routing.to(device),
        )


def _pad_rows(rows: Sequence[np.ndarray], R: int) -> torch.Tensor:
    out = torch.zeros((len(rows), R), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.from_numpy(np.array(r, dtype=np.float32))  # copy: Ray arrays are read-only
    return out


def pack_trajectories(trajectories: Sequence[Trajectory], pad_id: int) -> Batch:
    """Right-padded tensors of a shard (an empty shard gives a 0-row batch)."""
    if not trajectories:
        z = torch.zeros((0, 2), dtype=torch.long)
        tokens = TokenFields(behaviour_logprobs=torch.zeros((0, 1)), ref_logprobs=torch.zeros((0, 1)))
        return Batch(
            z,
            z.clone(),
            torch.ones(0, dtype=torch.long),
            torch.zeros((0, 1)),
            torch.zeros(0),
            tokens,
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.bool),
        )
    with_ref = [t.ref_logprobs is not None for t in trajectories]
    if any(with_ref) and not all(with_ref):
        raise ValueError(
            f"trajectories {[i for i, w in enumerate(with_ref) if not w]} carry no reference logprobs but "
            f"{sum(with_ref)} others do: a shard's reference comes from one place"
        )
    for i, t in enumerate(trajectories):
        r = len(t.response_ids)
        ref = len(t.ref_logprobs) if t.ref_logprobs is not None else r
        if len(t.behaviour_logprobs) != r or ref != r:
            raise ValueError(
                f"trajectory {i}: {r} response tokens but {len(t.behaviour_logprobs)} behaviour and "
                f"{ref} reference logprobs"
            )
    ids, attn, p_lens, mask = pack_sequences(
        [t.prompt_ids for t in trajectories], [t.response_ids for t in trajectories], pad_id
    )
    R = mask.shape[1]
    scores = torch.tensor([float(t.score) for t in trajectories], dtype=torch.float32)
    tokens = TokenFields(
        behaviour_logprobs=_pad_rows([t.behaviour_logprobs for t in trajectories], R),
        ref_logprobs=_pad_rows([t.ref_logprobs for t in trajectories], R) if all(with_ref) else None,
    )
    if any(t.action_mask is not None for t in trajectories):
        for i, t in enumerate(trajectories):
            if t.action_mask is not None and len(t.action_mask) != len(t.response_ids):
                raise ValueError(
                    f"trajectory {i}: {len(t.response_ids)} response tokens but {len(t.action_mask)} mask entries"
                )
        mask = mask * _pad_rows(
            [
                t.action_mask if t.action_mask is not None else np.ones(len(t.response_ids))
                for t in trajectories
            ],
            R,
        )
    if any(t.token_rewards is not None for t in trajectories):
        tokens.token_rewards = _pad_rows(
            [
                t.token_rewards if t.token_rewards is not None else np.zeros(len(t.response_ids))
                for t in trajectories
            ],
            R,
        )
    # A trajectory without a group (-1) is a group of its own: a distinct negative id.
    groups = torch.tensor([t.group if t.group >= 0 else -1 - i for i, t in enumerate(trajectories)])
    truncated = torch.tensor([bool(t.truncated) for t in trajectories])
    routing = _pad_routing(trajectories, ids.shape[1])
    return Batch(ids, attn, p_lens, mask, scores, tokens, groups, truncated, routing)


def _pad_routing(trajectories: Sequence[Trajectory], L: int) -> torch.Tensor | None:
    """The trajectories' recorded routing right-padded to [B, L, layers, k] with NOT_RECORDED (None when
    none carries any); a shard's routing comes from one place: all or none."""
    have = [t.routing is not None for t in trajectories]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(
            f"trajectories {[i for i, h in enumerate(have) if not h]} carry no routing but {sum(have)} others "
            "do: a shard's routing comes from one engine configuration (rollout.record_routing)"
        )
    shapes = {t.routing.shape[1:] for t in trajectories}
    if len(shapes) != 1:
        raise ValueError(f"trajectories' routing has differing [layers, k]: {sorted(shapes)}")
    out = torch.full((len(trajectories), L, *shapes.pop()), NOT_RECORDED, dtype=torch.uint8)
    for i, t in enumerate(trajectories):
        n = len(t.prompt_ids) + len(t.response_ids) - 1
        if t.routing.shape[0] != n or t.routing.dtype != np.uint8:
            raise ValueError(
                f"trajectory {i}: routing {t.routing.dtype} {tuple(t.routing.shape)}, expected uint8 with "
                f"{n} tokens (prompt + response but the last)"
            )
        out[i, :n] = torch.from_numpy(np.array(t.routing))  # copy: Ray arrays are read-only
    return out


def dummy_batch(pad_id: int) -> Batch:
    """One all-padding row with no valid token: the input of a zero-weight micro-batch."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long)
    return Batch(
        ids, torch.ones_like(ids), torch.ones(1, dtype=torch.long), torch.zeros((1, 1)), torch.zeros(1)
    )
