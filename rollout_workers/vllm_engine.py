"""vLLM backend (GPU only; `pip install 'rayppo[vllm]'`, vLLM >= 0.10.2 for `logprobs_mode`).

- Behaviour logprobs: vLLM's default `logprobs_mode="raw_logprobs"` is log_softmax of the raw
  logits, before temperature. `"processed_logprobs"` is log_softmax after temperature *and* after
  top-k/top-p masking. Only with top-k/top-p off is that our contract, log_softmax(logits / T), so
  this engine uses "processed_logprobs" and refuses top_k/top_p (use engine='hf' for those).
- Weight updates: a worker extension (`VLLMWeightLoader`, passed as `worker_extension_cls`) runs
  the model's own `load_weights` inside every vLLM worker process, reached with
  `LLM.collective_rpc`; with tensor parallelism each rank takes its shard. The prefix cache is reset
  afterwards, since cached KV blocks were computed with the old weights.
- Checksum: vLLM's fused parameters cannot be read back under HF names, so the checksum is that of
  the bundle that loaded without error (and, before any load, of the checkpoint on disk).
- Seeds: each prompt gets its own seed derived from (seed, prompt position); vLLM gives the k-th of
  the n samples seed + k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.engine import GenerationOutput, RolloutEngine, derive_seed, read_special_ids
from rollout_workers.weights import check_state_keys, state_checksum, torch_dtype

_LOADER = "rayppo_load_weights"


def import_vllm() -> Any:
    """The vllm module, or a RuntimeError saying how to get a working one."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(
            "rollout engine 'vllm' needs the vllm package, which is not importable here "
            f"({e}). Install it on GPU nodes with `pip install 'rayppo[vllm]'`, or set rollout.engine='hf'."
        ) from e
    if not torch.cuda.is_available():
        raise RuntimeError(
            "rollout engine 'vllm' needs a CUDA GPU and none is visible to this process "
            "(as a Ray actor, give rollout workers num_gpus_per_worker > 0), or set rollout.engine='hf'."
        )
    return vllm


class VLLMWeightLoader:
    """Mixed into each vLLM GPU worker via `worker_extension_cls`; its methods run in that worker."""

    def rayppo_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        runner = self.model_runner  # type: ignore[attr-defined]  # provided by the vLLM worker
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        device = next(model.parameters()).device
        loaded = model.load_weights(weights=((n, t.to(device)) for n, t in named))
        torch.cuda.synchronize(device)
        return -1 if loaded is None else len(loaded)


class VLLMEngine(RolloutEngine):
    name = "vllm"

    def __init__(self, model_path: str, config: RolloutConfig) -> None:
        self._vllm = import_vllm()
        from transformers import AutoConfig, AutoModelForCausalLM

        self._path = model_path
        self.dtype = torch_dtype(config.dtype)
        self.eos_token_ids, _ = read_special_ids(model_path)
        hf_config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        with torch.device("meta"):  # names and shapes of the HF state dict, without allocating weights
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        self._expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        self.vocab_size = int(skeleton.get_output_embeddings().weight.shape[0])
        text = hf_config.get_text_config()
        self.max_model_len = getattr(text, "max_position_embeddings", None) or getattr(
            text, "n_positions", None
        )
        self._checksum: str | None = None
        self._partial = False
        v = config.vllm
        self._llm = self._vllm.LLM(
            model=model_path,
            tokenizer=model_path,
            dtype=config.dtype,
            tensor_parallel_size=v.tensor_parallel_size,
            gpu_memory_utilization=v.gpu_memory_utilization,
            enforce_eager=v.enforce_eager,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # sampling comes from SamplingConfig only, never the checkpoint
            worker_extension_cls=f"{__name__}.{VLLMWeightLoader.__name__}",
            distributed_executor_backend="ray" if v.tensor_parallel_size > 1 else None,
        )

    def generate(
        self, prompts: list[np.ndarray], sampling: SamplingConfig, seed: int
    ) -> list[list[GenerationOutput]]:
        if sampling.top_k > 0 or sampling.top_p < 1.0:
            raise ValueError(
                "engine='vllm' cannot return log_softmax(logits / T) with top_k/top_p truncation on "
                f"(top_k={sampling.top_k}, top_p={sampling.top_p}); turn them off or use engine='hf'"
            )
        params = [
            self._vllm.SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                max_tokens=sampling.max_new_tokens,
                logprobs=0,  # the sampled token's logprob only
                seed=derive_seed(seed, i),
                stop_token_ids=sorted(self.eos_token_ids),
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        results = self._llm.generate(requests, params, use_tqdm=False)
        return [[self._convert(c) for c in sorted(r.outputs, key=lambda c: c.index)] for r in results]

    def _convert(self, completion: Any) -> GenerationOutput:
        ids = np.asarray(completion.token_ids, dtype=np.int64)
        lps = np.array(
            [step[int(t)].logprob for step, t in zip(completion.logprobs, ids, strict=True)], dtype=np.float32
        )
        # vLLM reports 'length' when the EOS is also the max_tokens-th token; our contract keys on the EOS.
        finish = "stop" if ids.size and int(ids[-1]) in self.eos_token_ids else "length"
        return GenerationOutput(response_ids=ids, logprobs=lps, finish_reason=finish)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        check_state_keys(state, self._expected, what=f"checkpoint {self._path}")
        self._checksum, self._partial = None, True  # until every rank has loaded the whole bundle
        counts = self._llm.collective_rpc(_LOADER, args=(list(state.items()),))
        if any(c == 0 for c in counts):
            raise RuntimeError(f"vLLM loaded no parameters from a bundle of {len(state)} tensors")
        self._llm.reset_prefix_cache()
        self._checksum, self._partial = state_checksum(state, self.dtype), False

    def weights_checksum(self) -> str:
        if self._partial:
            raise RuntimeError(
                "a weight load failed part-way: the weights are unknown until a full bundle loads"
            )
        if self._checksum is None:  # initial weights: the HF state dict of the checkpoint on disk
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                self._path, dtype=self.dtype, local_files_only=True, use_safetensors=True
            )
            self._checksum = state_checksum(model.state_dict(), self.dtype)
        return self._checksum
