"""ReferencePolicy and RewardScorer as real Ray actors give what the plain classes give."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import build_tokenizer

from reward_service.config import ReferenceConfig, RewardConfig
from reward_service.reference import ReferencePolicy
from reward_service.scorer import RewardScorer, ScoreBatch

TIMEOUT_S = 120


@pytest.mark.slow
def test_reference_and_scorer_as_ray_actors(ray_local, tiny_policy_dir, tiny_reward_dir):
    ray = ray_local
    tok = build_tokenizer()
    prompts = [np.array(tok.encode(p), dtype=np.int64) for p in ["the movie was", "i", "a very good"]]
    responses = [np.array(tok.encode(r), dtype=np.int64) for r in ["great .", "hated it and", "film"]]
    ref_cfg = ReferenceConfig(batch_size=2)
    rw_cfg = RewardConfig(kind="model", model_path=str(tiny_reward_dir), batch_size=2)

    ref = ray.remote(ReferencePolicy).options(num_cpus=0.25).remote(str(tiny_policy_dir), ref_cfg, 0.8)
    scorer = ray.remote(RewardScorer).options(num_cpus=0.25).remote(rw_cfg, str(tiny_policy_dir))
    try:
        assert ray.get([ref.ping.remote(), scorer.ping.remote()], timeout=TIMEOUT_S) == [True, True]
        lp_ref, batch = ray.get(
            [ref.logprobs.remote(prompts, responses), scorer.score.remote(prompts, responses)],
            timeout=TIMEOUT_S,
        )
        ref_stats, scorer_stats = ray.get([ref.stats.remote(), scorer.stats.remote()], timeout=TIMEOUT_S)
    finally:
        ray.kill(ref)
        ray.kill(scorer)

    local_lp = ReferencePolicy(str(tiny_policy_dir), ref_cfg, 0.8).logprobs(prompts, responses)
    for a, b in zip(lp_ref, local_lp, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    local = RewardScorer(rw_cfg, str(tiny_policy_dir)).score(prompts, responses)
    assert isinstance(batch, ScoreBatch) and batch.ok.all()
    np.testing.assert_allclose(batch.scores, local.scores, atol=1e-5, rtol=0)
    assert ref_stats["sequences"] == 3 and ref_stats["batches"] == 2
    assert scorer_stats["samples"] == 3 and scorer_stats["failures"] == 0
