"""The role classes the cluster runs: each role's plain class with the streaming adapters of
cluster/ added (the Ray actor classes of the separate placement; a colocated host builds them too).

In both pipelines samples travel between actors as object references, never through the driver: a
worker returns (small per-sample facts, samples) as two objects, and the reference, the scorer and
the learner read the samples object themselves. The roles keep their own interfaces; converting one
role's records into the next one's input is cluster/'s job, so it lives in these thin subclasses. This module imports torch, transformers and DeepSpeed (the
roles' own modules): `cluster.placement.actors` imports it only when it starts actors, so a driver that
starts none of them (the colocated placement) never pays for those imports.
"""

from __future__ import annotations

from typing import Any

import ray

from cluster.pipeline.chunks import PromptFacts, SampleFacts, sample_facts
from cluster.pipeline.groups import RankPart
from cluster.placement.actors import part_trajectories
from cluster.placement.pools import LOST_OBJECT_ERRORS
from learner.rank import LearnerRank
from reward_service.reference import ReferencePolicy
from reward_service.scorer import RewardScorer
from rollout_workers.worker import RolloutWorker


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
    ) -> tuple[list[SampleFacts], list]:
        """`generate`, returned as (facts per sample: prompt index, version, length, finish reason and
        the episode's facts; the samples). The driver fetches only the facts."""
        samples = self.generate(prompt_indices, prompts, seed, sampling, texts, metas)
        return [sample_facts(s) for s in samples], samples


class StreamingReference(ReferencePolicy):
    @ray.method(num_returns=2)
    def sample_logprobs(self, samples: list) -> tuple[int, list]:
        """(how many samples were scored, their reference logprobs): the driver waits on the count and
        hands the logprobs' reference to the learner, which reads them itself."""
        out = self.logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        return len(out), out


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
        )


class StreamingLearnerRank(LearnerRank):
    @ray.method(num_returns=2)
    def export_split(self, describe: Any = None, dtype: str | None = None) -> tuple[bool, Any]:
        """`export_weights` as (whether this rank holds the bundle, the bundle): the driver waits on
        the flag and publishes the bundle's reference; the bundle itself never reaches the driver."""
        bundle = self.export_weights(describe, dtype)
        return bundle is not None, bundle

    def train_parts(self, parts: list[RankPart]) -> dict[str, Any]:
        """`train_step` on trajectories assembled here from object references (`part_trajectories`).

        An input whose object is lost (its node died with the only copy) trains nothing anywhere:
        every rank learns whether any rank lost an input before the step's first collective, and
        all return `{"lost_parts": [positions in their own parts]}` so the driver can regenerate
        those prompts and give the rest of the batch back."""
        trajectories, lost = [], []
        for k, part in enumerate(parts):
            try:
                samples, ref_lps = ray.get([part.samples_ref, part.ref_logprobs_ref])
            except LOST_OBJECT_ERRORS:
                lost.append(k)
                continue
            trajectories += part_trajectories(part, samples, ref_lps)
        if self.any_rank(bool(lost)):
            return {"lost_parts": lost}
        return self.train_step(trajectories)
