"""The metrics a learner step returns (`LearnerRank.train_step`), declared once: the driver joins them
with its own (`cluster.reporting.metric_names`) into the step's row, and no name is both
(tests/test_metric_names.py). Their meanings: docs/metrics.md."""

from __future__ import annotations

from kernel.metric_names import MetricNames

LEARNER_METRICS = MetricNames(
    "learner",
    frozenset(
        {
            # the batch as the learner prepared it (learner/prepare.py, critic.py, bypass.py)
            "train/tokens",
            "train/sequences",
            "train/reward_mean",  # mean return of the sequences trained (the driver's rollout/reward_mean)
            "train/overlong_penalty_mean",
            "train/overlong_filtered",
            "train/proximal_bypassed",
            "train/proximal_bypass_off",
            "objective/kl",
            "rollout/logprob_gap",
            "values/mean",
            "values/clip_radius",
            "values/explained_variance",
            "returns/mean",
            "returns/std",
            "advantages/mean",
            "reward_norm/count",
            "reward_norm/mean",
            "reward_norm/std",
            "off_policy/behaviour_kl",  # k3 (learner/corrections.py)
            "off_policy/behaviour_kl_k1",
            "off_policy/ppl_ratio",
            "off_policy/clipped_frac",
            "off_policy/truncated_frac",
            "off_policy/masked_token_frac",
            "off_policy/masked_seq_frac",
            "off_policy/weight_mean",
            "off_policy/weight_max",
            # the update (learner/ppo_step.py)
            "loss/policy",
            "loss/value",
            "loss/entropy",
            "objective/kl_coef",
            "params/approx_kl",
            "params/grad_norm",
            "params/policy_clip_frac",
            "params/value_clip_frac",
            "train/log_ratio_clamped_tokens",
            "train/lr",
            "train/optimizer_steps",
            "train/skipped_steps",
            "train/compute_s",  # the slowest rank's seconds in the step (the driver's time/train is the call)
        }
    ),
)
