"""Learner -> rollout worker weights: the publisher (what each worker must hold), the object-store push
and its acknowledgements, the collective broadcast, and the async mode's per-worker versions."""
