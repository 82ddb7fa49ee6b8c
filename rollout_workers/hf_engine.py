"""transformers backend: batched sampling with a KV cache, on CPU or one GPU.

Why a small decode loop instead of `model.generate`: `generate(output_logits=True)` keeps every
step's raw logits ([steps, B*n, V] floats: gigabytes for real vocabularies) only to gather one value
per token, it samples from the global RNG, and it merges the checkpoint's `generation_config`
(repetition penalties, default top_k=50, ...) into the sampling. Here the behaviour logprob is
gathered at each step, sampling uses a private `torch.Generator`, and only `SamplingConfig` applies.

Behaviour logprobs are those of the distribution the token was actually drawn from (the rule of
every engine, `RolloutEngine`): log_softmax(truncate_logits(raw_logits / temperature)), i.e. the
tempered distribution, and with top_k/top_p on, truncated and renormalised. Without truncation
that is the full tempered distribution the learner and the reference recompute.

Interruption (`pipeline.partial_rollout`, contract in `engine.Interrupt`): before every sampled token
the loop asks whether new weights are due; when they are, it drops the KV cache, lets the weights be
swapped, and recomputes the cache of every token so far with one prefill of the batch (the rows keep
their positions and their sampling RNG). Keeping the old cache would be cheaper by that prefill but
would make the logprobs of later tokens those of neither version.

Sleep (contract in `RolloutEngine`): on a GPU, level 1 and level 2 both move the model to host memory
and return the freed blocks to the driver (`torch.cuda.empty_cache()`; transformers keeps no KV cache
between calls), and waking moves it back. Level 2 keeps that host copy rather than discarding the
weights: rebuilding from a pushed bundle alone would lose the non-persistent buffers (rotary
`inv_freq`, ...) and the tying of shared parameters; the contract still demands a load after a level-2
wake, so callers treat both backends the same. On CPU there is nothing to free: the hooks only
change the state.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kernel.moe_routing import moe_routers, record_routing
from kernel.sequences import fused_gelu_kwargs, right_padded, sequence_logprobs
from rollout_workers.adapter import AdapterSlots
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.engine import GenerationOutput, Interrupt, RolloutEngine, read_special_ids
from rollout_workers.weight_receiver import WeightGroupMember
from rollout_workers.weights import (
    check_state_keys,
    check_tied_copies,
    sampled_digest,
    state_checksum,
    tied_groups,
    torch_dtype,
)


class HFEngine(RolloutEngine):
    name = "hf"

    def __init__(self, model_path: str, config: RolloutConfig) -> None:
        torch.set_num_threads(config.torch_threads)
        self.dtype = torch_dtype(config.dtype)
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=self.dtype,
            local_files_only=True,
            use_safetensors=True,
            **fused_gelu_kwargs(AutoConfig.from_pretrained(model_path, local_files_only=True)),
        )  # the same GELU kernel as the learner and the reference
        self.model = model.to(self._device).eval()
        self.model.requires_grad_(False)
        self.eos_token_ids, self._pad = read_special_ids(model_path)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        cfg = self.model.config.get_text_config()
        self.max_model_len = getattr(cfg, "max_position_embeddings", None) or getattr(
            cfg, "n_positions", None
        )
        self._tied = tied_groups(self.model)
        self._group: WeightGroupMember | None = None  # learner rank 0's weight group, once joined
        self._keep_last = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._adapter: AdapterSlots | None = None  # LoRA layers, once an adapter loads (rollout.lora_sync)
        self._record = config.record_routing
        if self._record and not moe_routers(self.model):
            raise ValueError(
                f"rollout.record_routing: {type(self.model).__name__} has no MoE layers (no module with a "
                "router `gate` and fused `experts`); set it false for a dense policy"
            )

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, past=None):
        kwargs = {"logits_to_keep": 1} if self._keep_last else {}
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=pos,
            past_key_values=past,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1, :].float(), out.past_key_values

    def _routed(self, route: list, start: int, ids: torch.Tensor, *args):
        """`_forward`, keeping each MoE layer's experts for the fed columns start.. of the batch's
        sequences in `route[0]` (uint8 [B, columns, layers, k], made on first use) when recording."""
        if route is None:
            return self._forward(ids, *args)
        with record_routing(self.model) as taken:
            out = self._forward(ids, *args)
        B, S = ids.shape
        step = torch.stack([t[0].reshape(B, S, -1) for t in taken], dim=2).cpu()  # [B, S, layers, k]
        if route[0] is None:
            route[0] = torch.zeros((B, route[1], *step.shape[2:]), dtype=step.dtype)
        route[0][:, start : start + S] = step
        return out

    @torch.inference_mode()
    def _generate(
        self,
        prompts: list[np.ndarray],
        sampling: SamplingConfig,
        seed: int,
        stop_ids: frozenset[int],
        limits: list[int],
        interrupt: Interrupt | None = None,
    ) -> list[list[GenerationOutput]]:
        n, steps = sampling.n, max(limits)
        rows = [p for p in prompts for _ in range(n)]  # row i*n+k = sample k of prompt i
        B, P = len(rows), max(len(p) for p in rows)
        dev = self._device
        ids = torch.full((B, P), self._pad, dtype=torch.long)
        attn = torch.zeros((B, P), dtype=torch.long)
        for r, p in enumerate(rows):  # left padding: every row's last prompt token sits at column P-1
            ids[r, P - len(p) :] = torch.from_numpy(np.asarray(p, dtype=np.int64))
            attn[r, P - len(p) :] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        eos = torch.tensor(sorted(self.eos_token_ids | stop_ids), device=dev)
        limit = torch.tensor([m for m in limits for _ in range(n)], dtype=torch.long, device=dev)

        tokens = torch.full((B, steps), self._pad, dtype=torch.long, device=dev)
        logps = torch.zeros((B, steps), dtype=torch.float32, device=dev)
        lengths = limit.clone()
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # ended by EOS or a stop token
        ended = torch.zeros(B, dtype=torch.bool, device=dev)  # ended either way, or by its limit
        next_pos = attn.sum(-1, keepdim=True)  # real tokens sit at 0..p-1, as in an unpadded forward
        last_position = (self.max_model_len or 1 << 62) - 1

        past = None
        route = [None, P + steps] if self._record else None  # the experts of every fed column
        versions = None if interrupt is None else torch.empty((B, steps), dtype=torch.long)
        for t in range(steps):
            if interrupt is not None:
                if interrupt.due():  # the cache holds the old weights' keys and values: drop it
                    past = None
                    interrupt.swap()
                versions[:, t] = interrupt.version
            if past is None:  # one prefill of every token so far: the prompt at t = 0, after a swap all
                seen = torch.cat([ids, tokens[:, :t]], dim=1)
                positions = (attn.cumsum(-1) - 1).clamp(0, last_position)
                logits, past = self._routed(route, 0, seen, attn, positions)
            scaled = truncate_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
            logp = torch.log_softmax(scaled, dim=-1)  # the distribution sampled from
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            tok = torch.where(ended, torch.full_like(tok, self._pad), tok)
            tokens[:, t] = tok
            logps[:, t] = logp.gather(1, tok.unsqueeze(1)).squeeze(1)
            hit = ~ended & torch.isin(tok, eos)
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            done |= hit
            ended |= hit | (limit <= t + 1)
            if t == steps - 1 or bool(ended.all()):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
            logits, past = self._routed(route, P + t, tok.unsqueeze(1), attn, next_pos, past)
            # a row past its own limit is still fed (its outputs are ignored): keep its position in range
            next_pos = (next_pos + 1).clamp(max=last_position)

        tokens, logps, lengths, done = (
            tokens.cpu().numpy(),
            logps.cpu().numpy(),
            lengths.tolist(),
            done.tolist(),
        )
        outs = [
            GenerationOutput(
                response_ids=tokens[r, : lengths[r]].copy(),
                logprobs=logps[r, : lengths[r]].copy(),
                finish_reason="stop" if done[r] else "length",
                versions=None if versions is None else versions[r, : lengths[r]].numpy().copy(),
                routing=None
                if route is None
                else route[0][r, P - len(rows[r]) : P + lengths[r] - 1].numpy().copy(),
            )
            for r in range(B)
        ]
        return [outs[i * n : (i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def _load_weights(self, state: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        check_state_keys(state, {k: tuple(v.shape) for k, v in own.items()}, what=type(self.model).__name__)
        check_tied_copies(state, self._tied)
        for name, target in own.items():
            target.copy_(state[name])  # casts to the engine dtype/device; tied names share storage

    def _load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        if self._adapter is None:
            self._adapter = AdapterSlots(self.model, self.dtype)
        pairs, whole = self._adapter.check(state)
        self._unknown_weights = "an adapter load failed part-way"
        self._adapter.load(pairs, whole)

    def _held_adapter(self) -> dict[str, torch.Tensor]:
        if self._adapter is None:
            return {}
        return self._adapter.held()

    def _join_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float, backend: str
    ) -> None:
        if self._group is not None:
            self._group.close()
        self._group = WeightGroupMember(host, port, first_rank, world_size, timeout_s, backend)

    @torch.no_grad()
    def _receive_weights(self, min_version: int) -> tuple[int, str]:
        if self._group is None:
            raise RuntimeError("this engine has not joined a weight group (join_weight_group)")
        own = self.model.state_dict()
        with self._group.stream() as stream:
            stream.check({k: tuple(v.shape) for k, v in own.items()}, type(self.model).__name__, min_version)
            self._unknown_weights = "a weight load failed part-way"
            for name, t in stream.tensors(self.dtype):
                own[name].copy_(t)  # casts to the engine dtype/device; tied names share storage
            stream.check_tied(self._tied)
            return stream.version, stream.digest()

    def weights_checksum(self) -> str:
        return state_checksum(self.model.state_dict(), self.dtype)

    def weights_digest(self) -> str:
        return sampled_digest(self.model.state_dict().items(), self.dtype)

    @torch.inference_mode()
    def _probe_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        """One forward of the sequences right-padded into a batch (the weights are read once)."""
        ids, mask = right_padded(sequences, self._device)
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        lengths = mask.sum(-1).tolist()
        return [
            sequence_logprobs(lg[:n], row[:n]).cpu().numpy()
            for lg, row, n in zip(logits, ids, lengths, strict=True)
        ]

    def _release(self, level: int) -> None:
        if self._device.type == "cuda":
            self.model.to("cpu")  # in place: parameters keep their identity, tied ones stay tied
            torch.cuda.empty_cache()

    def _restore(self, level: int) -> None:
        if self._device.type == "cuda":
            self.model.to(self._device)


def truncate_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top_k most likely and outside the top_p nucleus.

    top_k=0 and top_p=1.0 are off. The nucleus keeps the smallest prefix of tokens, by decreasing
    probability, whose mass reaches top_p (always at least one token).
    """
    out = scaled
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = torch.sort(out, dim=-1, descending=True)
        p = torch.softmax(srt, dim=-1)
        drop = (p.cumsum(-1) - p) >= top_p  # mass strictly before this token already reaches top_p
        srt = srt.masked_fill(drop, float("-inf"))
        out = torch.empty_like(out).scatter_(-1, idx, srt)
    return out
