"""The learner rank's actor class: `LearnerRank` with the streaming adapters of cluster/ (see
`cluster.roles.actors` for the other roles' and the rule: samples travel as object
references, never through the driver). Its own module because it imports DeepSpeed, which no other
role's process needs."""

from __future__ import annotations

from cluster.roles.startup import pause_for_the_actors_start, start_up_step, starts_without_gc

pause_for_the_actors_start()  # the imports below are most of the actor's start (cluster.roles.startup)

from typing import Any  # noqa: E402

import ray  # noqa: E402

from cluster.records.groups import LostInputs, RankPart  # noqa: E402
from cluster.records.ray_waits import LOST_OBJECT_ERRORS  # noqa: E402
from cluster.records.trajectories import part_trajectories  # noqa: E402
from learner.rank import LearnerRank  # noqa: E402


@starts_without_gc
class StreamingLearnerRank(LearnerRank):
    @start_up_step
    def setup(self, master_addr: str, master_port: int) -> None:
        """`LearnerRank.setup` (the model's load and DeepSpeed's engine) as part of the rank's start."""
        super().setup(master_addr, master_port)

    @ray.method(num_returns=2)
    def export_split(
        self, describe: Any = None, dtype: str | None = None, probe: bool = True
    ) -> tuple[bool, Any]:
        """`export_weights` as (whether this rank holds the bundle, the bundle): the driver waits on
        the flag and publishes the bundle's reference; the bundle itself never reaches the driver."""
        bundle = self.export_weights(describe, dtype, probe)
        return bundle is not None, bundle

    def train_parts(
        self, parts: list[RankPart], engines_hold: int | None = None
    ) -> dict[str, Any] | LostInputs:
        """`train_step` on trajectories assembled here from object references (`part_trajectories`).

        An input whose object is lost (its node died with the only copy) trains nothing anywhere:
        every rank learns whether any rank lost an input before the step's first collective, and
        all return `LostInputs` (the positions in their own parts) so the driver can regenerate
        those prompts and give the rest of the batch back. `engines_hold`: see `LearnerRank.train_step`."""
        trajectories, lost = [], []
        for k, part in enumerate(parts):
            # no reference object where the learner computes the reference (learner.reference_from_base)
            refs = [part.samples_ref] + ([part.ref_logprobs_ref] if part.ref_logprobs_ref is not None else [])
            try:
                samples, *ref_lps = ray.get(refs)
            except LOST_OBJECT_ERRORS:
                lost.append(k)
                continue
            trajectories += part_trajectories(part, samples, ref_lps[0] if ref_lps else None)
        if self.any_rank(bool(lost)):
            return LostInputs(lost)
        return self.train_step(trajectories, engines_hold)
