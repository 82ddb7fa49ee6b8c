"""The methods this project adds to each vLLM worker (`worker_extension_cls`): they run inside vLLM's
worker processes, where the model lives, and are reached through `LLM.collective_rpc` by name. Weight
loads from a bundle or a broadcast, the weight group, and the digest of what the worker holds
(`rollout_workers.vllm_engine` is the engine side, in the rollout worker's process)."""

from __future__ import annotations

import torch

from rollout_workers.weight_receiver import WeightGroupError
from rollout_workers.weights import torch_dtype


class VLLMWeightLoader:
    """Mixed into each vLLM worker via `worker_extension_cls`; its methods run in that worker."""

    def rayppo_load_weights(self, blob: bytes) -> int:
        """The bundle as safetensors bytes (through a separate engine-core process)."""
        from safetensors.torch import load

        return self.rayppo_load_tensors(list(load(blob).items()))

    def rayppo_load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load named tensors (HF names, the engine's dtype) through the worker's own `reload_weights`."""
        self.reload_weights(weights_iterator=self._rayppo_recorded(named), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(named)

    def _rayppo_recorded(self, named):
        """`named` as it passes into vLLM's loader, each tensor's digest sample kept once all have passed
        (`rayppo_weights_digest` reads them where the module no longer holds the weights)."""
        from rollout_workers.weights import digest_sample

        seen = {}
        for name, tensor in named:
            seen[name] = (tuple(tensor.shape), digest_sample(tensor, None))
            yield name, tensor
        self.rayppo_loaded = seen

    def rayppo_join_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float, backend: str
    ) -> None:
        """Join learner rank 0's weight group as group rank `first_rank` + this worker's rank."""
        from rollout_workers.weight_receiver import WeightGroupMember

        if getattr(self, "rayppo_group", None) is not None:
            self.rayppo_group.close()
        rank = first_rank + self.rank  # type: ignore[attr-defined]
        self.rayppo_group = WeightGroupMember(host, port, rank, world_size, timeout_s, backend)

    def rayppo_receive_weights(
        self, expected: dict[str, tuple[int, ...]], tied: list[list[str]], min_version: int, dtype: str
    ) -> dict:
        """Receive the next broadcast bundle and load it bucket by bucket through `reload_weights` (each
        tensor-parallel rank takes its shard of the full tensors). {'refused': why} when the header
        does not fit (nothing loaded); else the version, the digest of what arrived and the count."""
        loading = False
        try:
            with self.rayppo_group.stream() as stream:
                try:
                    stream.check(expected, "the vLLM engine's model", min_version)
                except (KeyError, ValueError) as err:
                    return {"refused": str(err)}
                loading = True
                tensors = stream.tensors(torch_dtype(dtype))
                self.reload_weights(
                    weights_iterator=self._rayppo_recorded(tensors), is_checkpoint_format=True
                )  # type: ignore[attr-defined]
                stream.check_tied(tied)
                return {"version": stream.version, "digest": stream.digest(), "count": len(stream.shapes)}
        except WeightGroupError as err:  # as facts: vLLM's mp executor would turn it into a RuntimeError
            return {"group_error": str(err), "partial": loading}

    def rayppo_weights_digest(self) -> str:
        """`sampled_digest` of this worker's parameters under vLLM's own names (fused and sharded).

        vLLM's CPU build repacks the Linear weights out of the module after loading, leaving an empty
        parameter: a digest of the module alone would not move when only those change (a LoRA run's
        merged weights), and a load that changed them would look stale. Where a parameter is empty, the
        digest also covers the tensors the last load handed vLLM's own loader in this process (a load
        that never reached the worker leaves it as it was; whether the loader applied them is the probe's
        to show)."""
        from rollout_workers.weights import combine_digest, sampled_digest

        params = list(self.model_runner.model.named_parameters())  # type: ignore[attr-defined]
        held = sampled_digest(params)
        if all(p.numel() for _, p in params):
            return held
        return f"{held}+loaded:{combine_digest(getattr(self, 'rayppo_loaded', {}))}"

    def rayppo_adapter_digest(self) -> str:
        """`sampled_digest` of the LoRA adapters this worker holds, under vLLM's names with each adapter's
        id (vLLM packs q/k/v and gate/up into one module: comparable only with this engine's own earlier
        digests). Reads the worker's LoRA manager, a vLLM internal (`_adapter_manager`)."""
        from rollout_workers.weights import sampled_digest

        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        named = []
        for lora_id, lora in sorted(manager.list_adapters().items()):
            for module, weights in sorted(lora.loras.items()):
                for part in ("lora_a", "lora_b"):
                    tensors = getattr(weights, part)
                    for i, t in enumerate(tensors if isinstance(tensors, list) else [tensors]):
                        if t is not None:
                            named.append((f"{lora_id}:{module}.{part}.{i}", t))
        return sampled_digest(named)
