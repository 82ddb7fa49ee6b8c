"""The learner's algorithm parts by name, each registered once with what it needs.

Eight registries: advantage estimators (`learner.advantage`), policy losses (`learner.policy_loss`),
loss aggregations (`learner.loss_agg`), KL estimators (`learner.kl.estimator`,
`learner.kl.loss_estimator`), learning-rate schedules (`learner.lr_schedule`), off-policy correction
presets (`learner.off_policy`; its 'auto' is decided by the run config, cluster.config.resolved) and the
two parts of a composed rollout correction (`learner.rollout_correction.is_level` and `.reject`).
Everything else reads a part from here: the config's allowed values (`LearnerConfig`'s `Literal`s are
built from `names()`), the config's rules (an estimator that learns a critic, one that needs groups of
samples, a loss defined with one aggregation), the allowed-values text of the configuration reference
(`describe()`), and the function the learner calls (`function(name)`). A part names its function as
"module:function" and it is imported on first use, so this module, and the config with it, loads
without torch (the driver imports no framework).

Adding a part is one entry here, its function and its test; a part with parameters of its own also
declares their block (`section`, a strict model in a module without torch: learner/estimator_params.py,
learner/correction_params.py), which the learner's section then holds as `learner.<part name>`, or
under the field the part names (`section_field`: 'custom' has `learner.rollout_correction`, required
with it, `section_required`; learner/config_blocks.py). The function's signature is the registry's:
`learner.advantages.Estimate`, `learner.losses.Surrogate`, `learner.losses.Aggregate`,
`learner.losses.Correction`, and `f(d) -> KL_t` for a KL estimator with d = log pi - log pi_ref. This
module imports nothing of the project but the registry type (`kernel.registry`), so every role may
import it.
"""

from __future__ import annotations

import dataclasses

from kernel.registry import Part, Registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimator(Part):
    critic: bool = False  # learns a value function (value head, value loss, its optimizer state)
    groups: bool = False  # its baseline is a statistic over the samples of one prompt (n >= 2)
    outcome: bool = False  # broadcasts one advantage per sample: earlier turns' rewards join the score
    corrects_off_policy: bool = False  # importance weights pi/mu inside its targets (no off_policy weights)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLoss(Part):
    loss_agg: str | None = None  # the aggregation its objective is defined with (None: any)
    dual_clip: bool = True  # whether it takes learner.clip.dual (has a clipped branch to cap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Aggregation(Part):
    horizon: bool = False  # divides by a constant number of tokens (learner.loss_norm_tokens)


ADVANTAGES: Registry[Estimator] = Registry(
    "advantage estimator",
    "learner.advantage",
    [
        Estimator(
            name="gae",
            function="learner.advantages:gae_estimate",
            summary="GAE(gamma, lambda) with a learned critic (Schulman et al. 2015)",
            critic=True,
            section="learner.estimator_params:GAEParams",
        ),
        Estimator(
            name="grpo",
            function="learner.advantages:grpo_estimate",
            summary="the score minus its group's mean, divided by the group's std when grpo.norm_adv_by_std "
            "(Shao et al. 2024; Dr. GRPO, Liu et al. 2025: grpo.norm_adv_by_std false)",
            groups=True,
            outcome=True,
            section="learner.estimator_params:GRPOParams",
        ),
        Estimator(
            name="rloo",
            function="learner.advantages:rloo_estimate",
            summary="the score minus the mean of the other samples of its group (Ahmadian et al. 2024)",
            groups=True,
            outcome=True,
        ),
        Estimator(
            name="reinforce_pp",
            function="learner.advantages:reinforce_pp_estimate",
            summary="return-to-go of the KL-shaped reward, whitened over the global batch (REINFORCE++, Hu 2025)",
        ),
        Estimator(
            name="vtrace",
            function="learner.advantages:vtrace_estimate",
            summary="V-trace targets with a learned critic for samples of an older policy (Espeholt et al. 2018)",
            critic=True,
            corrects_off_policy=True,
            section="learner.estimator_params:VTraceParams",
        ),
    ],
)

POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss",
    "learner.policy_loss",
    [
        PolicyLoss(
            name="ppo",
            function="learner.losses:ppo_surrogate",
            summary="the clipped surrogate on each token's ratio pi/pi_old (Schulman et al. 2017), with "
            "clip.eps_high and clip.dual",
        ),
        PolicyLoss(
            name="gspo",
            function="learner.losses:gspo_surrogate",
            summary="the clipped surrogate on the sequence's ratio (pi/pi_old)^(1/|y|), the geometric mean of "
            "its tokens' ratios (GSPO, Zheng et al. 2025; its paper clips at 3e-4/4e-4)",
            loss_agg="seq-mean-token-mean",
        ),
        PolicyLoss(
            name="cispo",
            function="learner.losses:cispo_surrogate",
            summary="-sg(clip(r, 1 - clip.eps, 1 + clip.eps_high)) * A * log pi per token: the clipped ratio "
            "weights every token's policy gradient and clips none away (CISPO, MiniMax-M1, Chen et al. 2025; "
            "its paper sets no lower bound)",
            dual_clip=False,
        ),
    ],
)

LOSS_AGGS: Registry[Aggregation] = Registry(
    "loss aggregation",
    "learner.loss_agg",
    [
        Aggregation(
            name="token-mean",
            function="learner.losses:token_mean",
            summary="the mean over every valid token of the batch (DAPO)",
        ),
        Aggregation(
            name="seq-mean-token-mean",
            function="learner.losses:seq_mean_token_mean",
            summary="each sequence's token mean, then the mean over sequences (GRPO)",
        ),
        Aggregation(
            name="seq-mean-token-sum",
            function="learner.losses:seq_mean_token_sum",
            summary="each sequence's token sum, then the mean over sequences",
        ),
        Aggregation(
            name="seq-mean-token-sum-norm",
            function="learner.losses:seq_mean_token_sum_norm",
            summary="each sequence's token sum divided by the constant loss_norm_tokens, then the mean over "
            "sequences (Dr. GRPO, Liu et al. 2025)",
            horizon=True,
        ),
    ],
)

KL_ESTIMATORS: Registry[Part] = Registry(
    "KL estimator",
    "learner.kl.estimator / learner.kl.loss_estimator",
    [
        Part(name="k1", function="learner.algorithms:kl_k1", summary="log pi - log pi_ref (Schulman 2020)"),
        Part(name="k2", function="learner.algorithms:kl_k2", summary="(log pi - log pi_ref)^2 / 2"),
        Part(
            name="k3",
            function="learner.algorithms:kl_k3",
            summary="pi_ref/pi - 1 - log(pi_ref/pi): unbiased and >= 0",
        ),
    ],
)

SCHEDULES: Registry[Part] = Registry(
    "learning-rate schedule",
    "learner.lr_schedule",
    [
        Part(name="constant", function="learner.lr_schedule:constant", summary="lr after the warm-up"),
        Part(
            name="linear",
            function="learner.lr_schedule:linear",
            summary="linear decay to min_lr_ratio x lr at lr_schedule_steps",
        ),
        Part(
            name="cosine",
            function="learner.lr_schedule:cosine",
            summary="cosine decay to min_lr_ratio x lr at lr_schedule_steps",
        ),
    ],
)

OFF_POLICY: Registry[Part] = Registry(
    "off-policy correction",
    "learner.off_policy",
    [
        Part(
            name="none",
            function="learner.corrections:preset_none",
            summary="no correction: weight 1 on every token (the mismatch metrics are still reported)",
        ),
        Part(
            name="tis",
            function="learner.corrections:preset_tis",
            summary="min(rho, tis.cap) per token: truncated importance sampling (Espeholt et al. 2018); "
            "= rollout_correction {is_level: token, is_cap: tis.cap}",
            section="learner.correction_params:TISParams",
        ),
        Part(
            name="mask",
            function="learner.corrections:preset_mask",
            summary="1[rho <= mask.cap] per token: token rejection; "
            "= rollout_correction {reject: [{level: token, bounds: [0, mask.cap]}]}",
            section="learner.correction_params:MaskParams",
        ),
        Part(
            name="geo_mask",
            function="learner.corrections:preset_geo_mask",
            summary="drops every token of a sequence whose geometric-mean rho is outside geo_mask.bounds: "
            "sequence rejection; = rollout_correction {reject: [{level: geometric, bounds: geo_mask.bounds}]}",
            section="learner.correction_params:GeoMaskParams",
        ),
        Part(
            name="custom",
            function="learner.corrections:preset_custom",
            summary="the learner.rollout_correction block: an IS level times any rejections, composed",
            section="learner.correction_params:RolloutCorrectionConfig",
            section_field="rollout_correction",
            section_required=True,
        ),
    ],
)

ROLLOUT_IS: Registry[Part] = Registry(
    "rollout importance weight",
    "learner.rollout_correction.is_level",
    [
        Part(name="none", function="learner.corrections:no_is", summary="weight 1"),
        Part(
            name="token",
            function="learner.corrections:token_is",
            summary="min(rho_t, is_cap) per token: token TIS (Espeholt et al. 2018; verl rollout_is=token)",
        ),
        Part(
            name="sequence",
            function="learner.corrections:sequence_is",
            summary="min(prod_t rho_t, is_cap) on every token of the sequence, in log space: sequence TIS "
            "(verl rollout_is=sequence)",
        ),
    ],
)

ROLLOUT_REJECT: Registry[Part] = Registry(
    "rollout rejection",
    "learner.rollout_correction.reject[].level",
    [
        Part(
            name="token",
            function="learner.corrections:token_reject",
            summary="1[lo <= rho_t <= hi] per token (verl token_k1)",
        ),
        Part(
            name="sequence",
            function="learner.corrections:sequence_reject",
            summary="drops the sequence unless lo <= prod_t rho_t <= hi (verl seq_sum_k1)",
        ),
        Part(
            name="geometric",
            function="learner.corrections:geometric_reject",
            summary="drops the sequence unless lo <= (prod_t rho_t)^(1/|y|) <= hi (verl seq_mean_k1, SkyRL geo mask)",
        ),
        Part(
            name="outlier",
            function="learner.corrections:outlier_reject",
            summary="drops the sequence when any token has rho_t outside [lo, hi] (SkyRL outlier mask)",
        ),
        Part(
            name="icepop",
            function="learner.corrections:icepop_reject",
            summary="rho_t if lo <= rho_t <= hi else 0 per token: IcePop (Ling team 2025); needs is_level none",
        ),
    ],
)
