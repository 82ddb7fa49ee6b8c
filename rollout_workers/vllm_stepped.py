"""An interruptible generate call on vLLM (`pipeline.partial_rollout`): the worker steps vLLM's engine
itself and lets new weights in between steps (`rollout_workers.engine.Interrupt`). vLLM's own
`pause_generation` belongs to its AsyncLLM; the worker's engine is the synchronous `LLM`, whose
`LLMEngine` it drives with `add_request` / `step` / `abort_request`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rollout_workers.engine import GenerationOutput, Interrupt, derive_seed, finish_reason


class SteppedRun:
    """One interruptible generate call on vLLM's `LLMEngine`. Each of the n samples of prompt i is its own
    request with the seed vLLM gives the k-th child of a request (`derive_seed(seed, i) + k`), so while no
    weights are due the tokens are those of `VLLMEngine._generate`. When new weights are due, the
    unfinished requests are aborted (their KV blocks freed, so the load's prefix-cache reset takes
    effect), the weights swapped, and each sequence continues as a new request from its token ids: its
    prefill recomputes the KV cache with the new weights. A continuation samples with the seed
    `derive_seed(seed, i, k, swaps)`."""

    def __init__(
        self,
        params: Callable[..., Any],
        engine: Any,
        prompts,
        n: int,
        seed: int,
        stops,
        limits,
        lora: Callable[[], Any] = lambda: None,
    ) -> None:
        """`params(n=, max_tokens=, seed=, output_kind=)`: the SamplingParams of one request
        (`VLLMEngine._params` with the call's sampling and stop tokens); `lora()`: the LoRA request of the
        adapter the engine holds when a request is added (a continuation after a swap takes the new one)."""
        from vllm.sampling_params import RequestOutputKind

        self.params, self.engine, self.prompts, self.lora = params, engine, prompts, lora
        self.seed, self.stops, self.limits, self.delta = seed, stops, limits, RequestOutputKind.DELTA
        self.keys = [(i, k) for i in range(len(prompts)) for k in range(n)]
        self.ids: dict = {key: [] for key in self.keys}
        self.logprobs: dict = {key: [] for key in self.keys}
        self.versions: dict = {key: [] for key in self.keys}
        self.finished: set = set()
        self.swaps = 0

    def _rid(self, key: tuple[int, int]) -> str:
        return f"rayppo-{key[0]}-{key[1]}-{self.swaps}"

    def _add(self, key: tuple[int, int], seed: int) -> None:
        i = key[0]
        params = self.params(
            n=1, max_tokens=self.limits[i] - len(self.ids[key]), seed=seed, output_kind=self.delta
        )
        prompt = [int(t) for t in self.prompts[i]] + self.ids[key]
        self.engine.add_request(
            self._rid(key), {"prompt_token_ids": prompt}, params, lora_request=self.lora()
        )

    def until_done(self, interrupt: Interrupt) -> None:
        if interrupt.due():  # at the call's start nothing is computed yet: swap, then add the requests
            interrupt.swap()
        for i, k in self.keys:
            self._add((i, k), derive_seed(self.seed, i) + k)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                _, i, k, swap = out.request_id.rsplit("-", 3)
                key = (int(i), int(k))
                if int(swap) != self.swaps:  # output of a request aborted at an earlier swap
                    continue
                c = out.outputs[0]
                self.ids[key] += [int(t) for t in c.token_ids]
                self.logprobs[key] += [
                    lp[int(t)].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)
                ]
                self.versions[key] += [interrupt.version] * len(c.token_ids)
                if out.finished:
                    self.finished.add(key)
            if not interrupt.due():
                continue
            running = [key for key in self.keys if key not in self.finished]
            if running:
                self.engine.abort_request([self._rid(key) for key in running])
                interrupt.swap()
                self.swaps += 1
                for i, k in running:
                    self._add((i, k), derive_seed(self.seed, i, k, self.swaps))

    def abort(self) -> None:
        self.engine.abort_request([self._rid(key) for key in self.keys if key not in self.finished])

    def outputs(self) -> list[GenerationOutput]:
        return [
            GenerationOutput(
                np.asarray(self.ids[key], dtype=np.int64),
                np.asarray(self.logprobs[key], dtype=np.float32),
                finish_reason(self.ids[key], self.stops),
                np.asarray(self.versions[key], dtype=np.int64),
            )
            for key in self.keys
        ]
