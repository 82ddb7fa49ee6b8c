"""Sampling clients of the Tinker API on a rollout engine of the project (the serve config's
`rollout.engine`, a name of `rollout_workers.engines.ENGINES`: hf or vLLM).

`save_weights_for_sampler` (what `save_weights_and_get_sampling_client` sends) takes the tenant's adapter
(`learner.lora.adapter_bundle`) and loads it into the training session's engine for that base model
(a Ray actor started on the first snapshot, with room for that snapshot's LoRA rank (`Engine.fit_adapters`),
and kept until the session ends: an RL loop that snapshots every step reuses it) through `rollout.lora_sync:
adapter`'s path (hf: PEFT layers inside the engine's model; vLLM: its own LoRA support). The future
resolves, and the sampling session exists, only once the engine acknowledges the weights as a rollout
worker's push is acknowledged (`cluster.weights.push.verify_ack`): an engine that reads its adapter back
(hf) by its `adapter_checksum`, equal to the bundle's `state_checksum` at the engine's dtype; one that
cannot (vLLM packs the adapter's tensors) by its own adapter digest having moved with the load and by its
logprobs on the fixed probe sequences (`kernel.sequences.probe_sequences`), equal within the float32 probe
tolerance to the tenant's on the snapshot's weights (its `forward`, computed with the snapshot). So a
sampling client never samples from weights the engine has not acknowledged. The session keeps that
snapshot (the bundle stays in Ray's object store until the training session ends): when another snapshot
was loaded since, a sample loads this one back, acknowledged the same way, before it draws (Tinker's
`kind: snapshot`: later training steps do not reach it).

`asample` draws `num_samples` responses with the engine's own contract (`RolloutEngine.generate`): each
token's logprob is that of the distribution it was drawn from (temperature, top_k / top_p applied);
`prompt_logprobs` are the engine's teacher-forced logprobs of the prompt (`probe_logprobs`, temperature
1), NaN at position 0 as the SDK expects. A response ends at the model's EOS, a `stop` token id or a
`stop` string (`cluster.serve.stop_strings`: finish 'stop'), or after `max_tokens` ('length').
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import uuid
from typing import Any

import numpy as np
import ray
import torch
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoConfig, AutoTokenizer

from cluster.serve.futures import Done, UserError
from cluster.serve.stop_strings import stop_at_strings
from cluster.serve.wire import WireDatum, encode_sample_response
from cluster.weights.push import expected_fingerprint, verify_ack
from kernel.sequences import probe_sequences
from rollout_workers.adapter import bundle_rank, split_bundle
from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.engines import ENGINES
from rollout_workers.types import WeightAck
from rollout_workers.weights import state_checksum

ENGINE_DTYPE = torch.float32  # RolloutConfig's default dtype, at which the acknowledgement compares


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _Params(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class _Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class _Prompt(_Body):
    chunks: list[_Chunk]


class SampleBody(_Body):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: int = Field(1, ge=1)
    prompt: _Prompt
    sampling_params: _Params
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None


@dataclasses.dataclass
class EngineSlot:
    """A training session's engine for one base model; `lock` keeps a start, a load and the draw after it
    together. `engine` is None until its first use and after it died (the next use starts another);
    `released` once its session ended (an engine still starting then is killed, never kept)."""

    path: str  # the base model's folder
    rollout: RolloutConfig  # the section its engine is built from (fitted to the first snapshot's rank)
    engine: Any = None  # ray ActorHandle of the engine class (`rollout.engine`)
    held: str = ""  # the checksum of the adapter it holds now
    released: bool = False
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    loads: int = 0  # adapters loaded so far (the version its acknowledgements name)
    reads_back: bool | None = None  # whether its adapter_checksum reads the adapter back (None: no load yet)


@dataclasses.dataclass(frozen=True)
class Probe:
    """The tenant's teacher-forced logprobs (temperature 1) of tokens 1.. of each probe sequence, on a
    snapshot's weights: what an engine that cannot read its adapter back must compute after loading it."""

    sequences: list[np.ndarray]
    logprobs: list[np.ndarray]

    def saved(self) -> dict[str, list[torch.Tensor]]:
        """As a named sampler checkpoint keeps it (tensors: `torch.load(weights_only=True)` reads it back)."""
        return {
            k: [torch.from_numpy(np.asarray(a)) for a in getattr(self, k)] for k in ("sequences", "logprobs")
        }

    @classmethod
    def from_saved(cls, saved: dict[str, list[torch.Tensor]] | None) -> Probe | None:
        if saved is None:
            return None
        return cls(*([t.numpy() for t in saved[k]] for k in ("sequences", "logprobs")))


@dataclasses.dataclass
class SamplerSession:
    owner: str
    session_id: str  # the training session whose model it samples (released with it)
    base_model: str
    slot: EngineSlot
    bundle: Any  # ray ObjectRef of the snapshot's adapter bundle
    checksum: str  # the snapshot's checksum, which the engine acknowledged
    vocab_size: int
    max_len: int | None
    tokenizer: Any  # the base model's, for stop strings
    model_path: str | None = None  # the sampler checkpoint it was made from (create_sampling_session)
    reference: Probe | None = None  # the tenant's probe logprobs on the snapshot (None: saved without)


@dataclasses.dataclass(frozen=True)
class SampleCall:
    prompt: np.ndarray
    sampling: SamplingConfig
    seed: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    prompt_logprobs: bool


def sample_call(body: SampleBody, session: SamplerSession) -> SampleCall:
    """The engine call a request asks for; a UserError names any field this service does not take."""
    unserved = {
        "topk_prompt_logprobs": body.topk_prompt_logprobs, "topk_sample_logprobs": body.topk_sample_logprobs,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k, "target_prompt_logprobs": body.target_prompt_logprobs,
        "prompt_logprobs_last_n": body.prompt_logprobs_last_n,
    }  # fmt: skip
    asked = sorted(k for k, v in unserved.items() if v)
    if asked:
        raise UserError(f"asample: {asked} are not served (tokens, their logprobs and prompt_logprobs are)")
    kinds = {c.type for c in body.prompt.chunks} - {"encoded_text"}
    if kinds:
        raise UserError(f"asample: prompt chunks {sorted(kinds)} are not served; encoded_text only")
    prompt = np.asarray([t for c in body.prompt.chunks for t in c.tokens], dtype=np.int64)
    p = body.sampling_params
    if p.max_tokens is None or p.max_tokens < 1:
        raise UserError(f"asample: sampling_params.max_tokens must be >= 1 (got {p.max_tokens})")
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or ())
    strings = tuple(s for s in stop if isinstance(s, str))
    if strings and len(strings) != len(stop):
        raise UserError("asample: sampling_params.stop mixes strings and token ids; send one kind")
    if "" in strings:
        raise UserError("asample: sampling_params.stop holds an empty string, which would stop at once")
    if p.stop == []:
        raise UserError("asample: sampling_params.stop=[] (never stop at EOS) is not served")
    if len(prompt) == 0 or prompt.min() < 0 or prompt.max() >= session.vocab_size:
        raise UserError(f"asample: prompt tokens must be 0..{session.vocab_size - 1} and at least one")
    if session.max_len is not None and len(prompt) + p.max_tokens > session.max_len:
        raise UserError(
            f"asample: prompt {len(prompt)} + max_tokens {p.max_tokens} > the model's {session.max_len}"
        )
    sampling = SamplingConfig(
        temperature=p.temperature, top_k=max(p.top_k, 0), top_p=p.top_p, max_new_tokens=p.max_tokens,
        n=body.num_samples,
    )  # fmt: skip
    seed = secrets.randbits(31) if p.seed is None else int(p.seed) % (2**31)
    ids = frozenset() if strings else frozenset(stop)
    return SampleCall(prompt, sampling, seed, ids, strings, bool(body.prompt_logprobs))


class Samplers:
    def __init__(self, engine_cpus: float, rollout: RolloutConfig, start_timeout_s: float = 300.0) -> None:
        """`rollout`: the section engines are built from (`ServeConfig.sampling_rollout`)."""
        self.engine_class = ray.remote(num_cpus=engine_cpus)(ENGINES.function(rollout.engine))
        self.rollout = rollout
        self.start_timeout_s = start_timeout_s
        self.sessions: dict[str, SamplerSession] = {}
        self.slots: dict[tuple[str, str], EngineSlot] = {}  # (training session, base model) -> engine
        self.tokenizers: dict[str, Any] = {}  # base model path -> its tokenizer
        self.ended: set[str] = set()  # training sessions released: no engine starts for them

    def _tokenizer(self, path: str) -> Any:
        if path not in self.tokenizers:
            self.tokenizers[path] = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return self.tokenizers[path]

    def session(self, sid: str | None, owner: str) -> SamplerSession:
        s = self.sessions.get(sid or "")
        if s is None or s.owner != owner:
            raise UserError(f"unknown sampling_session_id {sid!r}")
        return s

    def _fitted(self, rank: int) -> RolloutConfig:
        """The engine's section with room for rank-`rank` adapters (`Engine.fit_adapters`: vLLM fixes its
        `max_lora_rank` when built); a UserError naming the field set below it."""
        try:
            return ENGINES[self.rollout.engine].fit_adapters(self.rollout, rank)
        except ValueError as err:
            raise UserError(
                f"a LoRA adapter of rank {rank} (the training client's, learner.lora.rank here) does not fit the "
                f"serve config's sampling engine: {err}"
            ) from None

    def _slot(self, session_id: str, base_model: str, path: str, rank: int) -> EngineSlot:
        """The session's slot for `base_model` (its engine starts on first use, `_engine`); none for a
        session that has ended."""
        if session_id in self.ended:
            raise UserError(f"session {session_id!r} has ended: its sampling engines are stopped")
        key = (session_id, base_model)
        if key not in self.slots:
            self.slots[key] = EngineSlot(path, self._fitted(rank))
        return self.slots[key]

    async def _engine(self, slot: EngineSlot) -> Any:
        """The slot's engine, started if it has none (first use, or after it died); the caller holds the
        lock. The handle is on the slot before the first await, so a `release` meanwhile kills it."""
        if slot.engine is not None:
            return slot.engine
        engine = slot.engine = self.engine_class.remote(slot.path, slot.rollout)
        slot.held = ""
        try:
            await asyncio.wait_for(engine.adapter_checksum.remote(), self.start_timeout_s)
        except TimeoutError:
            ray.kill(engine)
            slot.engine = None
            raise RuntimeError(
                f"the sampling engine did not start within {self.start_timeout_s:g}s (start_timeout_s): "
                "does the cluster have free CPUs for it (tenant_cpus)?"
            ) from None
        except ray.exceptions.RayActorError as e:
            slot.engine = None
            if not slot.released:
                raise RuntimeError(f"the sampling engine died while it started: {e}") from None
        if slot.released:  # its session ended meanwhile: `release` killed it
            raise UserError("the session ended while its sampling engine started; the engine was stopped")
        return engine

    @staticmethod
    def _died(slot: EngineSlot, engine: Any, error: Exception, what: str) -> Exception:
        """The error of a call that was in a slot's engine when it died; the slot forgets the engine, so
        its next use starts another and loads the snapshot it needs (acknowledged as every load is)."""
        if slot.engine is engine:
            slot.engine, slot.held = None, ""
        if slot.released:
            return UserError(f"{what}: its session ended, which stopped its sampling engine")
        return RuntimeError(
            f"{what}: the sampling engine died ({type(error).__name__}: {str(error).splitlines()[0]}); "
            "nothing was drawn. The next call starts a new engine and loads its sampling client's "
            "snapshot again (kept by the service, acknowledged as before)"
        )

    async def _load(self, slot: EngineSlot, bundle_ref: Any, expected: str, reference: Probe | None) -> None:
        """Load a snapshot into the slot's engine and check its acknowledgement (the caller holds the lock):
        the checksum where the engine reads its adapter back, else its digest and probe (`verify_ack`)."""
        engine = await self._engine(slot)
        if slot.held == expected:
            return
        known, slot.held = slot.held, ""  # unknown until acknowledged
        slot.loads += 1
        # an engine that cannot read its adapter back: its own digest must move when the adapter changes
        before = await engine.adapter_digest.remote() if slot.reads_back is False else None
        await engine.load_adapter.remote(bundle_ref)
        checksum = await engine.adapter_checksum.remote()
        slot.reads_back = checksum is not None
        changed = None if before is None else (await engine.adapter_digest.remote()) != before
        probe = None
        if checksum is None:  # the engine cannot read its adapter back: what it computes acknowledges it
            if reference is None:
                raise UserError(
                    "this sampler checkpoint holds no probe logprobs (saved before the service kept them), which "
                    "the sampling engine's acknowledgement needs: save it again with save_weights_for_sampler"
                )
            probe = await engine.probe_logprobs.remote(reference.sequences)
        ack = WeightAck(slot.loads, probe, checksum, changed=changed, bundle_changed=bool(known))
        dtype = self.rollout.dtype  # the tenant's too (float32)
        meta = {"probe": None if probe is None else reference.logprobs, "checksum": expected, "dtype": dtype}
        verify_ack("the sampling engine", ack, slot.loads, expected_fingerprint(meta, slot.loads, dtype))
        slot.held = expected

    async def reference(self, tenant_actor: Any, path: str) -> Probe:
        """The tenant's probe logprobs on its weights now (its `forward`, after the calls sent before)."""
        vocab = int(AutoConfig.from_pretrained(path, local_files_only=True).get_text_config().vocab_size)
        sequences = probe_sequences(vocab)
        data = [WireDatum(s[:-1], {"target_tokens": s[1:]}) for s in sequences]  # t scores s[t + 1]
        out = await tenant_actor.forward_backward.remote(data, "cross_entropy", {}, True)
        return Probe(sequences, [o["logprobs"] for o in out.outputs])

    async def save_for_sampler(
        self, tenant_actor, base_model: str, path: str, owner: str, session_id: str
    ) -> Done:
        bundle_ref = tenant_actor.adapter_bundle.remote()
        reference = await self.reference(tenant_actor, path)  # the same weights: sent after the bundle's copy
        sid = await self.open_session(bundle_ref, base_model, path, owner, session_id, reference=reference)
        return Done({"sampling_session_id": sid, "type": "save_weights_for_sampler"})

    async def open_session(
        self, bundle_ref: Any, base_model: str, path: str, owner: str, session_id: str,
        model_path: str | None = None, reference: Probe | None = None,
    ) -> str:  # fmt: skip
        """A sampling session on `bundle_ref` (an adapter bundle, or its ObjectRef) in the training
        session's engine for `base_model`; it exists only once the engine acknowledged the bundle
        (`reference`: the tenant's probe logprobs on it, which an engine without a checksum needs)."""
        if not isinstance(bundle_ref, ray.ObjectRef):
            bundle_ref = ray.put(bundle_ref)
        bundle = await bundle_ref
        expected = state_checksum(bundle, ENGINE_DTYPE)
        slot = self._slot(session_id, base_model, path, bundle_rank(split_bundle(bundle)[0]))
        async with slot.lock:
            try:
                await self._load(slot, bundle_ref, expected, reference)
            except ray.exceptions.ActorDiedError as e:
                raise self._died(slot, slot.engine, e, "save_weights_for_sampler") from None
        cfg = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
        max_len = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        sid = str(uuid.uuid4())
        self.sessions[sid] = SamplerSession(
            owner,
            session_id,
            base_model,
            slot,
            bundle_ref,
            expected,
            int(cfg.vocab_size),
            max_len,
            self._tokenizer(path),
            model_path,
            reference,
        )
        return sid

    def release(self, session_id: str) -> None:
        """A training session ended: its sampling sessions go, its engines are killed (one still starting
        too), and no engine is started for it from now on."""
        self.ended.add(session_id)
        for sid in [k for k, v in self.sessions.items() if v.session_id == session_id]:
            del self.sessions[sid]
        for key in [k for k in self.slots if k[0] == session_id]:
            slot = self.slots.pop(key)
            slot.released = True
            if slot.engine is not None:
                ray.kill(slot.engine)

    async def sample(self, session: SamplerSession, call: SampleCall) -> Done:
        slot = session.slot
        async with slot.lock:  # another snapshot may have been loaded since: this one back, acknowledged
            try:
                await self._load(slot, session.bundle, session.checksum, session.reference)
                engine = slot.engine
                drawn = await engine.generate.remote([call.prompt], call.sampling, call.seed, call.stop_ids)
                outs = drawn[0]
                prompt_lp = None
                if call.prompt_logprobs:
                    probe = (await engine.probe_logprobs.remote([call.prompt]))[0]
                    prompt_lp = np.concatenate([[np.nan], probe]).astype(np.float32)
            except ray.exceptions.ActorDiedError as e:
                raise self._died(slot, slot.engine, e, "asample") from None
        seqs = [_cut(o, call.stop_strings, session.tokenizer) for o in outs]
        return Done(body=encode_sample_response(seqs, prompt_lp))


def _cut(out: Any, stops: tuple[str, ...], tokenizer: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """(tokens, logprobs, finish reason) of one engine output, ended at its first stop string."""
    end = stop_at_strings(out.response_ids, stops, lambda t: tokenizer.decode(t, skip_special_tokens=False))
    if end is not None:
        return out.response_ids[:end], out.logprobs[:end], "stop"
    return out.response_ids, out.logprobs, "stop" if out.finish_reason == "stop" else "length"
