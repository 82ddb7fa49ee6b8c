"""One learner rank: a DeepSpeed ZeRO engine over the policy+value model, in one torch.distributed world.

A plain class; `cluster/` wraps it with `ray.remote` (one actor per rank inside a placement group)
and calls every collective method on all ranks concurrently.
What a rank writes to disk and reads back (checkpoints, the final model) is `learner.rank_checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from kernel.sequences import check_packing_exact, probe_sequences, right_padded
from learner.advantages import needs_critic
from learner.algorithms import AdaptiveKLController, FixedKLController
from learner.batch import Trajectory
from learner.bundle_probe import bundle_probe_logprobs
from learner.bypass import ProximalBypass
from learner.config import LearnerConfig
from learner.context import LearnerContext
from learner.critic import RunningMoments
from learner.deepspeed_setup import (
    free_port,
    init_distributed,
    initialize_engine,
    node_ip,
    remove_shm_buffers,
    resolve_backend,
)
from learner.lora import adapter_bundle, has_lora, merged_cpu_state_dict
from learner.model import PolicyWithValueHead
from learner.ppo_step import train_step
from learner.rank_checkpoint import Carried, Where, load_checkpoint, save_checkpoint, save_model
from learner.shared_bundle import SharedSegment, export_layout, segment_views, write_rank_part
from learner.shared_bundle import room as shared_room

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Exported(NamedTuple):
    """One export on this rank: the bundle (None off rank 0), the probe's logprobs when the training
    engine scored them, whether rank 0 still scores them from the bundle, and the stages' seconds."""

    bundle: dict[str, torch.Tensor] | None
    scored: list[np.ndarray] | None
    probe_from_bundle: bool
    timings: dict[str, float]


class LearnerRank:
    """Owns this rank's engine, KL controller and RNG; the controller drives it step by step."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_path: str,
        config: LearnerConfig,
        seed: int = 0,
        pad_token_id: int = 0,
        temperature: float = 1.0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of size {world_size}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.rank, self.world_size = rank, world_size
        self.model_path = str(model_path)
        self.config = config
        self.seed = int(seed)
        self.pad_token_id = int(pad_token_id)
        self.temperature = float(temperature)
        kl = config.kl
        self.kl_controller = (
            AdaptiveKLController(kl.coef, kl.target, kl.horizon)
            if kl.adaptive
            else FixedKLController(kl.coef)
        )
        # Running score statistics for learner.reward_norm: fed from all ranks, so the same everywhere.
        self.reward_moments = RunningMoments()
        self.bypass = ProximalBypass(config)
        # Same seed on every rank: identical shuffling logic, each over its own shard.
        self.generator = torch.Generator().manual_seed(self.seed)
        self.engine = None
        self._addr: tuple[str, int] | None = None
        self._fingerprint: dict | None = None  # what workers must acknowledge for the last export
        self._weight_group = None  # rank 0: broadcast group with the rollout workers (collective sync)
        self._segment: SharedSegment | None = None  # the shared weight segment: rank 0's own, or opened

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port: called on rank 0, passed to every rank's `setup`."""
        return node_ip(), free_port()

    def ping(self) -> bool:
        return True

    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the world and build the engine (all ranks at once: rendezvous and ZeRO partitioning)."""
        if self.engine is not None:
            raise RuntimeError(f"learner rank {self.rank} is already set up")
        torch.set_num_threads(self.config.torch_threads)
        self._addr = (str(master_addr), int(master_port))
        init_distributed(
            self.rank,
            self.world_size,
            master_addr,
            master_port,
            resolve_backend(self.config),
            self.config.dist_timeout_s,
        )
        model = PolicyWithValueHead.for_learner(self.model_path, self.config, self.seed)
        if self.config.pack_sequences:  # on the full weights, before ZeRO-3 partitions them
            vocab = model.policy.config.get_text_config().vocab_size
            check_packing_exact(model.policy, vocab, "learner.pack_sequences")
        if not needs_critic(self.config.advantage):
            # No critic: the value head is frozen, so it gets no gradient and no optimizer state.
            model.value_head.requires_grad_(False)
        torch.manual_seed(self.seed + self.rank)
        self.engine = initialize_engine(model, self.config)

    def _require_engine(self):
        if self.engine is None:
            raise RuntimeError(
                f"learner rank {self.rank} is not set up: call setup(master_addr, master_port) first"
            )
        return self.engine

    def train_step(self, trajectories: list[Trajectory], engines_hold: int | None = None) -> dict[str, float]:
        """One PPO iteration on this rank's shard; metrics are global and identical on every rank.
        `engines_hold`: the version of the learner's current weights every rollout engine acknowledged, as
        the driver vouches for it (None: not vouched); with it the step may skip the proximal pass
        (`learner.bypass`)."""
        versions = [t.policy_version for t in trajectories]
        bypass = self.bypass.decide(versions, engines_hold, lambda ok: not self.any_rank(not ok))
        ctx = LearnerContext(
            self._require_engine(),
            self.config,
            self.temperature,
            self.pad_token_id,
            self.generator,
            self.reward_moments,
        )
        metrics = train_step(ctx, trajectories, self.kl_controller, bypass)
        metrics.update(self.bypass.record(metrics, bypass))
        return metrics

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on at least one (a collective: all ranks call it)."""
        from learner.forward import all_reduce

        return bool(all_reduce([float(flag)], "max", self._require_engine().device)[0] > 0)

    def optimizer_name(self) -> str:
        """The class of the optimizer DeepSpeed steps ("AdamW", or "DeepSpeedCPUAdam" when offloaded)."""
        return type(self._require_engine().optimizer.optimizer).__name__

    def kl_coef(self) -> float:
        return float(self.kl_controller.value)

    @property
    def _bucket_bytes(self) -> int:
        return int(self.config.export_bucket_mb * 2**20)

    def export_weights(
        self,
        describe: Callable[[dict[str, torch.Tensor]], dict] | None = None,
        dtype: str | None = None,
        probe: bool = True,
        into: tuple[SharedSegment, int] | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """The policy's full weights under HF names on rank 0 (CPU copies, floating tensors in `dtype`, e.g.
        the rollout dtype, cast bucket by bucket: None keeps the training dtype); None elsewhere.

        All ranks must call it (ZeRO-3 gathers shards, one bucket of `learner.export_bucket_mb` at a
        time: see learner.gather). With `learner.lora` the adapters are merged into the base weights
        (learner.lora.merged_cpu_state_dict): the bundle has the base model's names; with
        `learner.export_adapter` the bundle is the adapter alone (learner.lora.adapter_bundle). Tied
        weights stay one shared tensor. Rank 0 also records what a
        rollout worker must acknowledge for these weights (`export_fingerprint`): the policy's logprobs
        on the fixed probe when `probe` (None otherwise: on a CPU learner learner.bundle_probe scores them
        from the bundle on rank 0; on a GPU, or for an adapter-only bundle, a forward of every rank) and,
        when `describe` is given, the facts `describe(bundle)` returns (the cluster's: checksum and
        digest at the rollout dtype).

        With `into` (a shared-memory segment and a bucket size: `learner.shared_bundle`), every rank
        writes its own part of a policy without LoRA straight into the segment, nothing gathered, and
        rank 0's bundle is views of it; a LoRA policy is merged and gathered as above.
        """
        exported = self._export_bundle(dtype, probe, into)
        if exported.bundle is not None:
            self._record_fingerprint(exported, describe)
        return exported.bundle

    def _export_bundle(
        self, dtype: str | None, probe: bool, into: tuple[SharedSegment, int] | None
    ) -> Exported:
        """`export_weights` up to the bundle (and the probe where the training engine scores it); the rest
        of the fingerprint is `_record_fingerprint`'s."""
        engine = self._require_engine()
        t0 = time.perf_counter()
        # A full bundle on a CPU learner is scored from its own tensors on rank 0 after the gather: over
        # gloo, a ZeRO-3 forward fetching every parameter through DeepSpeed's hooks costs several times the
        # export's bucketed gather. On a GPU that forward (NCCL) is cheaper than moving the bundle back to
        # the device, and an adapter-only bundle cannot run alone: both take the training engine's forward.
        on_engine = probe and (self.config.export_adapter or engine.device.type != "cpu")
        scored = self._probe_logprobs() if on_engine else None
        t1 = time.perf_counter()
        cast = None if dtype is None else EXPORT_DTYPES[dtype]
        policy = engine.module.policy
        if into is not None and not has_lora(policy):  # a LoRA policy is merged and gathered, then copied in
            out = self._export_into(*into, cast)
        else:
            export = adapter_bundle if self.config.export_adapter else merged_cpu_state_dict
            out = export(policy, self._bucket_bytes, keep=self.rank == 0, dtype=cast)
        timings = {"probe_s": t1 - t0, "gather_s": time.perf_counter() - t1}
        return Exported(out, scored, probe and not on_engine, timings)

    def _record_fingerprint(
        self, exported: Exported, describe: Callable[[dict[str, torch.Tensor]], dict] | None
    ) -> None:
        """Rank 0: the fingerprint of the bundle just exported (`export_fingerprint`): the probe from the
        bundle where it is due, and `describe`'s facts."""
        engine = self._require_engine()
        bundle, scored, timings = exported.bundle, exported.scored, exported.timings
        t0 = time.perf_counter()
        if exported.probe_from_bundle:
            scored = bundle_probe_logprobs(
                engine.module.policy.config,
                bundle,
                probe_sequences(self._vocab_size()),
                engine.device,
                EXPORT_DTYPES[self.config.dtype],
            )
        t1 = time.perf_counter()
        facts = describe(bundle) if describe else {}
        timings = {**timings, "probe_s": timings["probe_s"] + t1 - t0, "describe_s": time.perf_counter() - t1}
        self._fingerprint = {"probe": scored, "dtype": self.config.dtype, **facts, "timings": timings}

    def _export_into(
        self, segment: SharedSegment, bucket_bytes: int, dtype: torch.dtype | None
    ) -> dict[str, torch.Tensor] | None:
        """`export_weights` of a policy without LoRA into `segment` (all ranks): each rank's part written in
        place, then a barrier; rank 0 returns the bundle as views of the segment."""
        state = self._require_engine().module.policy.state_dict(keep_vars=True)
        layout = export_layout(state, bucket_bytes, dtype)
        flat = segment.resize(layout.segment_bytes())
        with torch.no_grad():
            write_rank_part(state, layout, flat, self.rank, self.world_size)
        if self.world_size > 1:
            dist.barrier()  # every rank's part is in place before rank 0 reads the bundle
        return segment_views(layout, flat) if self.rank == 0 else None

    def weight_segment_room(self, dtype: str | None) -> tuple[int, int]:
        """(bytes a shared weight segment needs for the policy's bundle at `dtype`, bytes free where it
        would be made): whether this node's /dev/shm can hold it (`learner.shared_bundle`)."""
        state = self._require_engine().module.policy.state_dict(keep_vars=True)
        cast = None if dtype is None else EXPORT_DTYPES[dtype]
        return export_layout(state, 1 << 62, cast).segment_bytes(), shared_room()

    def _shared_segment(self, path: str) -> SharedSegment:
        """Rank 0's own segment (made by `join_weight_group`); on another rank, `path` opened (kept)."""
        if self._segment is None or self._segment.path != path:
            if self.rank == 0:
                raise RuntimeError(
                    f"learner rank 0 holds no shared weight segment {path} (join_weight_group)"
                )
            self._segment = SharedSegment(path)
        return self._segment

    def join_weight_group(
        self,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        shared: bool | str = False,
    ) -> str | None:
        """Rank 0 hosts a weight group (`learner.weight_broadcast`) of itself and `world_size - 1`
        processes holding rollout engines' weights; each collective on it fails after `timeout_s`. With
        `shared` (every member and learner rank on this host) bundles travel through a shared-memory
        segment of rank 0's (`learner.shared_bundle`, kept while the group lasts), or with
        `shared='cuda_ipc'` (every member on this device) through a CUDA buffer of rank 0's
        (`learner.cuda_ipc_bundle`): returns its path, for every rank's `broadcast_weights`."""
        if self.rank != 0:
            raise RuntimeError(f"learner rank {self.rank}: only rank 0 broadcasts weights")
        from learner.weight_broadcast import close_group, open_group

        if self._weight_group is not None:  # a group of other members: close its connections first
            previous, self._weight_group = self._weight_group[0], None
            close_group(previous)
            del previous
        self._weight_group = (open_group(host, port, 0, world_size, timeout_s, backend), timeout_s, backend)
        if self._segment is not None:
            self._segment.remove()
        if shared == "cuda_ipc":
            from learner.cuda_ipc_bundle import CudaIpcSegment

            self._segment = CudaIpcSegment.create()
        else:
            self._segment = SharedSegment.create() if shared else None
        return None if self._segment is None else self._segment.path

    def broadcast_weights(
        self,
        version: int,
        bucket_mb: float,
        describe: Callable[[dict[str, torch.Tensor]], dict] | None = None,
        dtype: str | None = None,
        probe: bool = True,
        shared: str | None = None,
    ) -> int:
        """`export_weights` on every rank, then rank 0 broadcasts the bundle tagged `version` over its weight
        group in buckets of `bucket_mb` MiB; returns the bytes sent (0 on other ranks). With `shared`
        (the segment path `join_weight_group` returned) every rank writes its part there and rank 0
        broadcasts only the header (`learner.shared_bundle`). A failed
        broadcast (`WeightBroadcastError`, naming the bucket) also drops the group: its members' own
        receives then fail at once instead of waiting out their timeout, and the group is formed again."""
        from learner.weight_broadcast import WeightBroadcastError, broadcast_state, close_group

        bucket_bytes = int(bucket_mb * 2**20)
        segment = None if shared is None else self._shared_segment(shared)
        exported = self._export_bundle(dtype, probe, None if segment is None else (segment, bucket_bytes))
        state = exported.bundle
        if state is None:
            return 0
        if self._weight_group is None:
            raise RuntimeError("learner rank 0 has not joined a weight group (join_weight_group)")
        group, timeout_s, backend = self._weight_group
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        try:
            t0 = time.perf_counter()
            sent = broadcast_state(group, state, version, bucket_bytes, timeout_s, device, segment)
            send_s = time.perf_counter() - t0
            # after the send: the probe from the bundle and the checksum overlap the receivers' loads
            self._record_fingerprint(exported, describe)
            self._fingerprint["timings"]["send_s"] = send_s
            return sent
        except WeightBroadcastError as err:
            failure = str(err)  # raised below without this traceback, whose frames hold the group
        self._weight_group = None
        close_group(group)
        del group
        raise WeightBroadcastError(failure)

    def export_fingerprint(self) -> dict | None:
        """Rank 0: `{"probe", "dtype", ...describe's facts}` of the last `export_weights` (None before one)."""
        return self._fingerprint

    def _vocab_size(self) -> int:
        """Rows of the policy's output embedding (its full shape under ZeRO-3)."""
        weight = self._require_engine().module.policy.get_output_embeddings().weight
        return int(getattr(weight, "ds_shape", weight.shape)[0])

    @torch.no_grad()
    def _probe_logprobs(self) -> list[np.ndarray]:
        """Teacher-forced logprobs (temperature 1) of tokens 1.. of each probe sequence, through the
        same forward as training (all ranks call it: ZeRO-3 gathers parameters inside). One forward of
        the sequences right-padded into a batch: causal attention never sees the padding after a
        position, and one pass gathers (ZeRO-3) and reads the weights once instead of per sequence."""
        engine = self._require_engine()
        ids, mask = right_padded(probe_sequences(self._vocab_size()), engine.device)
        prompt = torch.ones((len(ids),), dtype=torch.long, device=engine.device)
        logits, _ = engine(ids, mask, prompt, ids.shape[1] - 1, 1.0)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return [row[: int(n) - 1].cpu().numpy() for row, n in zip(logp, mask.sum(-1), strict=True)]

    def save_pretrained(self, path: str, tokenizer_from: str | None = None) -> None:
        """Rank 0 writes the HF policy, value head and tokenizer files (copied from `tokenizer_from`,
        default the policy's folder) to `path`; all ranks must call it (the full weights are gathered
        bucket by bucket, as for `export_weights`). With `learner.lora` the policy is the merged model
        and the adapter alone goes to `path/adapter/` in PEFT's format (`learner.rank_checkpoint`)."""
        engine = self._require_engine()
        save_model(engine, path, tokenizer_from or self.model_path, self.model_path, self.config, self._where)

    def save_checkpoint(self, path: str, client_state: dict) -> None:
        """Weights, optimizer, LR schedule, KL controller, running reward moments and every rank's RNG
        into the folder `path`, in `learner.checkpoint_format` (all ranks must call it).

        'consolidated' (learner.consolidated_checkpoint) loads into any number of ranks; 'deepspeed' is
        DeepSpeed's per-rank ZeRO files. Everything must load with weights_only=True: RNG states are
        uint8 tensors, `client_state` is checked here so a bad one fails now rather than on resume.
        """
        engine = self._require_engine()
        save_checkpoint(engine, path, client_state, self._carried, self.config.checkpoint_format, self._where)

    def load_checkpoint(self, path: str) -> dict:
        """Restore what `save_checkpoint` wrote (either format, told apart by its files); returns the
        caller's `client_state`. All ranks must call it. A consolidated checkpoint loads into any world
        size, DeepSpeed's per-rank files into the same one; every file is read weights-only (which RNG a
        rank takes, what is refused: `learner.rank_checkpoint.load_checkpoint`)."""
        return load_checkpoint(self._require_engine(), path, self._carried, self._where)

    @property
    def _carried(self) -> Carried:
        """What this rank carries across a checkpoint beside its engine (`learner.rank_checkpoint`)."""
        return Carried(self.kl_controller, self.reward_moments, self.generator)

    @property
    def _where(self) -> Where:
        return Where(self.rank, self.world_size, self._bucket_bytes)

    def shutdown(self) -> None:
        """Leave the process group and delete any DeepSpeed /dev/shm buffer of this rank, and rank 0's
        shared weight segment (`learner.shared_bundle`)."""
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.engine = None
        if self._addr is not None:
            remove_shm_buffers(*self._addr, self.rank)
        if self._segment is not None:  # rank 0's weight segment goes (another rank's is only closed)
            self._segment.remove()
            self._segment = None
