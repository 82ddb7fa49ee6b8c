"""The role classes the cluster runs: each role's plain class with the streaming adapters of
cluster/ added (the Ray actor classes of the separate placement; a colocated host builds them too).

In both pipelines samples travel between actors as object references, never through the driver: a
worker returns (small per-sample facts, samples) as two objects, and the reference, the scorer and
the learner read the samples object themselves. The roles keep their own interfaces; converting one
role's records into the next one's input is cluster/'s job, so it lives in these thin subclasses.

One module per side: this one holds the rollout worker, the reference and the scorer (torch and
transformers); the learner rank's lives in `cluster.roles.learner_actor` (DeepSpeed too), so an actor
process imports only its own role's modules (an actor imports the module that defines its class: a
worker importing DeepSpeed as well paid ~2.6 s more of start-up). `cluster.placement.launch` imports both
only when it starts actors, so a driver that starts none of them (the colocated placement) never pays
for those imports.
"""

from __future__ import annotations

from cluster.roles.startup import pause_for_the_actors_start, starts_without_gc

pause_for_the_actors_start()  # the imports below are most of the actor's start (cluster.roles.startup)

from typing import Any  # noqa: E402

import ray  # noqa: E402

from cluster.records.chunks import PromptFacts, SampleFacts, sample_facts  # noqa: E402
from cluster.roles.judge_engines import judge_model  # noqa: E402
from reward_service.reference import ReferencePolicy  # noqa: E402
from reward_service.scorer import RewardScorer  # noqa: E402
from rollout_workers.worker import RolloutWorker  # noqa: E402


@starts_without_gc
class StreamingRolloutWorker(RolloutWorker):
    @ray.method(num_returns=2)
    def generate_chunk(
        self,
        prompt_indices: list[int],
        prompts: list,
        seed: int,
        sampling: Any = None,
        texts: list[str] | None = None,
        metas: list[dict] | None = None,
        messages: list | None = None,
    ) -> tuple[list[SampleFacts], list]:
        """`generate`, returned as (facts per sample: prompt index, version, length, finish reason and
        the episode's facts; the samples). The driver fetches only the facts."""
        samples = self.generate(prompt_indices, prompts, seed, sampling, texts, metas, messages)
        return [sample_facts(s) for s in samples], samples


@starts_without_gc
class StreamingReference(ReferencePolicy):
    @ray.method(num_returns=2)
    def sample_logprobs(self, samples: list) -> tuple[int, list]:
        """(how many samples were scored, their reference logprobs): the driver waits on the count and
        hands the logprobs' reference to the learner, which reads them itself."""
        out = self.logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        return len(out), out


@starts_without_gc
class StreamingScorer(RewardScorer):
    def score_samples(self, samples: list, prompts: dict[int, PromptFacts]) -> Any:
        """`score` of the samples, each with its prompt's text, messages and meta (`prompt_facts`)."""
        rows = [prompts[s.prompt_index] for s in samples]
        return self.score(
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            [r.meta for r in rows],
            [s.episode for s in samples],
            prompt_texts=[r.text for r in rows],
            messages=[r.messages for r in rows],
            finish_reasons=[s.finish_reason for s in samples],
            rows=[s.prompt_index for s in samples],
        )


@starts_without_gc
class StreamingJudge(StreamingScorer):
    """The scorer with kind='judge', its judge served by reward.judge.engine (`cluster.roles.judge_engines`)."""

    def __init__(self, config: Any, policy_tokenizer_path: str, torch_threads: int = 1) -> None:
        model = judge_model(config, torch_threads)
        super().__init__(config, policy_tokenizer_path, torch_threads, judge_model=model)
