"""The roles as parts: their descriptors (`registry`) and the actor classes the cluster runs them as
(`actors` for the rollout worker, the reference and the scorer; `learner_actor` for a learner rank)."""
