"""Rollout corrections: per-token weights that correct the PPO loss for the mismatch between the policy
that sampled a batch (the behaviour policy mu: the rollout engine, maybe older weights, other numerics)
and the learner's proximal policy pi_prox, and the mismatch metrics that measure it. Pure tensor code.

A correction is an importance-sampling part times a rejection part (verl's "rollout correction":
`rollout_is` x `rollout_rs`; SkyRL's `off_policy_correction`), both registered in `learner.registry`:
- IS (`ROLLOUT_IS`, `learner.rollout_correction.is_level`): 'none', 'token' (truncated IS per token,
  min(rho_t, C)), 'sequence' (truncated IS of the sequence, min(prod_t rho_t, C), in log space);
- rejections (`ROLLOUT_REJECT`, `learner.rollout_correction.reject`, a list: a token is kept when every
  one keeps it): 'token', 'sequence' (the product of the ratios), 'geometric' (their geometric mean),
  'outlier' (a row with any token outside), each two-sided in [lo, hi]; 'icepop' (IcePop's two-sided
  token mask, whose kept tokens carry rho_t as their weight).
`learner.off_policy` names a preset (`OFF_POLICY`): the older one-field settings 'tis', 'mask' and
'geo_mask', each a fixed (IS, rejection) pair, or 'custom' (the `learner.rollout_correction` block).

Conventions as in `learner.algorithms`: tensors `[B, T]` over response tokens, `mask` 1 on a row's valid
prefix, invalid entries (even NaN) never change an output; rho_t = pi_prox(y_t) / mu(y_t) with its log
clamped to +-LOG_RATIO_CLAMP before any exp. A rejected token gets weight 0 and stays in the loss
aggregation's denominators (see docs/algorithms.md, "Rollout corrections", for verl's other choice).

References: Espeholt et al. 2018 (IMPALA, truncated IS); Yao et al. 2025 ("Your efficient RL framework
secretly brings you off-policy RL training", token TIS); Liu, Li et al. 2025 ("When speed kills
stability", sequence TIS/MIS and geometric rejection; verl `rollout_corr_helper.py`); Ling team 2025
("Every step evolves", Ring-1T: IcePop); SkyRL `off_policy_correction_utils.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from kernel.registry import resolve
from learner.algorithms import LOG_RATIO_CLAMP, _valid, _zero_invalid, kl_penalty
from learner.config import LearnerConfig
from learner.registry import OFF_POLICY, ROLLOUT_IS, ROLLOUT_REJECT


@dataclasses.dataclass(frozen=True)
class Reject:
    """One rejection: a registered level (`ROLLOUT_REJECT`) and the kept range [lo, hi] of the ratio it
    reads, 0 <= lo <= 1 <= hi (lo = 0: one-sided)."""

    level: str
    bounds: tuple[float, float]

    def __post_init__(self):
        ROLLOUT_REJECT[self.level]  # unknown: ValueError naming the allowed ones
        lo, hi = self.bounds
        if not 0 <= lo <= 1 <= hi < math.inf:
            raise ValueError(
                f"rollout_correction.reject bounds must satisfy 0 <= lo <= 1 <= hi (got {(lo, hi)})"
            )


@dataclasses.dataclass(frozen=True)
class Correction:
    """One rollout correction: an IS level with its cap C, and the rejections whose multipliers multiply
    it (all must keep a token; `learner.rollout_correction`, or a preset of `learner.off_policy`)."""

    is_level: str = "none"
    is_cap: float = 2.0
    reject: tuple[Reject, ...] = ()

    def __post_init__(self):
        ROLLOUT_IS[self.is_level]  # unknown: ValueError naming the allowed ones
        if not self.is_cap > 0:
            raise ValueError(f"rollout_correction.is_cap must be > 0 (got {self.is_cap})")
        icepops = sum(r.level == "icepop" for r in self.reject)
        if icepops and (self.is_level != "none" or icepops > 1):
            raise ValueError(
                "rollout_correction: an 'icepop' rejection weights its kept tokens by rho itself: it needs "
                f"is_level 'none' and comes once (got is_level={self.is_level!r}, {icepops} icepop)"
            )


@dataclasses.dataclass(frozen=True)
class Ratios:
    """What the IS and rejection parts read: rho_t and its clamped log, the mask and its valid tokens,
    and each row's valid-token count."""

    rho: torch.Tensor
    log_rho: torch.Tensor  # 0 on invalid tokens
    mask: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor  # [B] valid tokens per row

    @property
    def log_seq(self) -> torch.Tensor:
        """[B, 1] log prod_t rho_t = sum_t log rho_t."""
        return self.log_rho.sum(-1, keepdim=True)

    @property
    def log_geo(self) -> torch.Tensor:
        """[B, 1] log of the geometric mean: (1/|y|) sum_t log rho_t."""
        return self.log_seq / self.lengths.clamp(min=1.0).unsqueeze(-1)


# An IS part: (ratios, cap C) -> (weights [B, T], truncated [B, T] bool).
ImportanceWeights = Callable[[Ratios, float], tuple[torch.Tensor, torch.Tensor]]
# A rejection part: (ratios, (lo, hi)) -> (multiplier [B, T], rejected [B, T] bool).
Rejection = Callable[[Ratios, tuple[float, float]], tuple[torch.Tensor, torch.Tensor]]


def no_is(r: Ratios, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """'none': weight 1."""
    return torch.ones_like(r.rho), torch.zeros_like(r.valid)


def token_is(r: Ratios, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """'token': w_t = min(rho_t, C) (token TIS: Espeholt et al. 2018; Yao et al. 2025; verl rollout_is=token)."""
    return r.rho.clamp(max=cap), r.rho > cap


def sequence_is(r: Ratios, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """'sequence': every token of row i carries w_i = min(prod_t rho_it, C) = exp(min(sum_t log rho_it,
    log C)), computed in log space (sequence TIS: Liu, Li et al. 2025; verl rollout_is=sequence)."""
    log_cap = math.log(cap)
    w = torch.exp(r.log_seq.clamp(max=log_cap)).expand_as(r.rho)
    return w, (r.log_seq > log_cap).expand_as(r.valid)


def _in_bounds(log_x: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    lo, hi = bounds
    low = -math.inf if lo == 0 else math.log(lo)
    return (log_x >= low) & (log_x <= math.log(hi))


def _keep(keep: torch.Tensor, r: Ratios) -> tuple[torch.Tensor, torch.Tensor]:
    keep = keep.expand_as(r.valid)
    return keep.to(r.rho.dtype), ~keep


def token_reject(r: Ratios, bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """'token': 1[lo <= rho_t <= hi] (token rejection, two-sided; lo = 0 makes it one-sided; verl
    rollout_rs=token_k1, SkyRL token_mask_is_threshold_low/high)."""
    return _keep(_in_bounds(r.log_rho, bounds), r)


def sequence_reject(r: Ratios, bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """'sequence': 1[lo <= prod_t rho_it <= hi] on every token of row i, compared in log space
    (sequence rejection, Seq-MIS: Liu, Li et al. 2025; verl seq_sum_k1, SkyRL sequence_mask 'product')."""
    return _keep(_in_bounds(r.log_seq, bounds), r)


def geometric_reject(r: Ratios, bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """'geometric': 1[lo <= (prod_t rho_it)^(1/|y_i|) <= hi] on every token of row i: the geometric mean,
    a length-independent per-token mismatch (Geo-RS: Liu, Li et al. 2025 part 3; verl seq_mean_k1, SkyRL
    sequence_mask 'geometric')."""
    return _keep(_in_bounds(r.log_geo, bounds), r)


def outlier_reject(r: Ratios, bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """'outlier': drops the whole row when any of its tokens has rho_t outside [lo, hi]:
    prod_t 1[lo <= rho_t <= hi] on every token of the row (SkyRL's outlier_token_is_threshold_low/high,
    recommended wide, e.g. [1e-4, 100], on top of a geometric mask)."""
    inside = _in_bounds(r.log_rho, bounds) | ~r.valid
    return _keep(inside.all(-1, keepdim=True), r)


def icepop_reject(r: Ratios, bounds: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """'icepop': M(rho_t) = rho_t if lo <= rho_t <= hi else 0 (IcePop, Ling team 2025, "Every step
    evolves", Ring-1T: alpha = 0.5, beta = 5 there): a kept token carries its ratio, a token outside the
    band carries nothing, so both tails are discarded rather than truncated. Equal to token TIS with a cap
    >= hi times the two-sided token mask (verl token IS + token_k1; SkyRL token TIS + token mask)."""
    keep, rejected = token_reject(r, bounds)
    return r.rho * keep, rejected


@dataclasses.dataclass(frozen=True)
class CorrectionSums:
    """This rank's sums behind the step's correction and mismatch metrics; added over ranks, then divided
    (`metrics`). Tokens are valid tokens, sequences rows with at least one."""

    tokens: float
    sequences: float
    weight: float  # sum of the weights
    truncated: float  # tokens whose IS weight was truncated at the cap
    masked_tokens: float  # tokens rejected
    masked_sequences: float  # sequences with at least one rejected token
    hit: float  # tokens truncated or rejected
    kl_k1: float  # sum_t (log mu - log pi_prox)
    kl_k3: float  # sum_t (rho_t - 1 - log rho_t)
    ppl_ratio: float  # sum_i exp(mean_t log mu_it - mean_t log pi_prox_it)

    def metrics(self, weight_max: float) -> dict[str, float]:
        """The step's metrics (names in learner.metric_names, meanings in docs/metrics.md)."""
        t, s = max(self.tokens, 1.0), max(self.sequences, 1.0)
        return {
            "off_policy/weight_mean": self.weight / t,
            "off_policy/weight_max": weight_max,
            "off_policy/clipped_frac": self.hit / t,
            "off_policy/truncated_frac": self.truncated / t,
            "off_policy/masked_token_frac": self.masked_tokens / t,
            "off_policy/masked_seq_frac": self.masked_sequences / s,
            "off_policy/behaviour_kl": self.kl_k3 / t,
            "off_policy/behaviour_kl_k1": self.kl_k1 / t,
            "off_policy/ppl_ratio": self.ppl_ratio / s,
        }


def correction_weights(
    prox_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, c: Correction
) -> tuple[torch.Tensor, CorrectionSums, float]:
    """w_t = IS_t * prod_k R_kt (`c.is_level`'s weight times each rejection's multiplier), 0 on invalid
    tokens; a token is rejected when any rejection rejects it.
    Returns `(weights [B, T], this rank's sums, the largest weight)`. The mismatch sums (k1 and k3 KL of
    mu against pi_prox from mu's samples, verl's perplexity ratio) read the unclamped log-ratios."""
    valid = _valid(mask)
    log_rho = _zero_invalid(prox_logprobs - behaviour_logprobs, mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    lengths = mask.to(log_rho.dtype).sum(-1)
    r = Ratios(torch.exp(log_rho), log_rho, mask, valid, lengths)
    is_fn: ImportanceWeights = ROLLOUT_IS.function(c.is_level)
    w, truncated = is_fn(r, c.is_cap)
    rejected = torch.zeros_like(valid)
    for step in c.reject:
        reject_fn: Rejection = ROLLOUT_REJECT.function(step.level)
        keep, hit = reject_fn(r, step.bounds)
        w, rejected = w * keep, rejected | hit
    w = _zero_invalid(w, mask)
    with torch.no_grad():
        truncated, rejected = truncated & valid, rejected & valid
        rows = valid.any(-1)
        lp_mu = _zero_invalid(behaviour_logprobs, mask)
        lp_prox = _zero_invalid(prox_logprobs, mask)
        log_ppl_diff = (lp_mu - lp_prox).sum(-1) / lengths.clamp(min=1.0)
        sums = CorrectionSums(
            tokens=float(lengths.sum()),
            sequences=float(rows.sum()),
            weight=float(w.sum()),
            truncated=float(truncated.sum()),
            masked_tokens=float(rejected.sum()),
            masked_sequences=float(rejected.any(-1).sum()),
            hit=float((truncated | rejected).sum()),
            kl_k1=float((lp_mu - lp_prox).sum()),
            kl_k3=float(_zero_invalid(kl_penalty(behaviour_logprobs, prox_logprobs, "k3"), mask).sum()),
            ppl_ratio=float(torch.where(rows, torch.exp(log_ppl_diff), torch.zeros(())).sum()),
        )
        weight_max = float(w[valid].max()) if bool(valid.any()) else 0.0
    return w, sums, weight_max


def from_config(cfg: LearnerConfig) -> Correction:
    """The correction `learner.off_policy` names ('auto' reads as 'none': the run config decides it)."""
    name = "none" if cfg.off_policy == "auto" else cfg.off_policy
    return OFF_POLICY.function(name)(cfg)


# The presets of learner.off_policy (`OFF_POLICY`): the learner's section -> the correction, from the
# preset's parameter block (`cfg.params(name)`: learner/correction_params.py).
def preset_none(cfg: LearnerConfig) -> Correction:
    """'none': no weight, no rejection (the mismatch metrics are still reported)."""
    return Correction()


def preset_tis(cfg: LearnerConfig) -> Correction:
    """'tis': token TIS with C = learner.tis.cap."""
    return Correction(is_level="token", is_cap=cfg.params("tis").cap)


def preset_mask(cfg: LearnerConfig) -> Correction:
    """'mask': token rejection on [0, learner.mask.cap] (one-sided)."""
    return Correction(reject=(Reject("token", (0.0, cfg.params("mask").cap)),))


def preset_geo_mask(cfg: LearnerConfig) -> Correction:
    """'geo_mask': geometric rejection on learner.geo_mask.bounds."""
    return Correction(reject=(Reject("geometric", tuple(cfg.params("geo_mask").bounds)),))


def preset_custom(cfg: LearnerConfig) -> Correction:
    """'custom': the learner.rollout_correction block (required with it: learner/config_blocks.py)."""
    rc = cfg.params("custom")
    return Correction(rc.is_level, rc.is_cap, tuple(Reject(x.level, tuple(x.bounds)) for x in rc.reject))


def off_policy_weights(
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "tis",
    cap: float = 2.0,
    geo_bounds: tuple[float, float] = (0.5, 2.0),
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights of a one-field preset of learner.off_policy ('none', 'tis', 'mask', 'geo_mask') with
    its cap and geometric bounds (its block's `cap` / `bounds`, checked as the config checks them), and
    this batch's means: weight_mean/max, clipped_frac (truncated or rejected), behaviour_kl (k3). The
    learner itself calls `correction_weights` (learner.prepare)."""
    section = OFF_POLICY[mode].section  # an unknown mode: ValueError naming the allowed ones
    given = {"cap": cap, "bounds": tuple(geo_bounds)}
    block = {} if section is None else {k: v for k, v in given.items() if k in resolve(section).model_fields}
    cfg = LearnerConfig(off_policy=mode, **({} if section is None else {mode: block}))
    w, s, mx = correction_weights(prox_logprobs, behaviour_logprobs, mask, from_config(cfg))
    m = s.metrics(mx)
    return w, {
        "weight_mean": m["off_policy/weight_mean"],
        "weight_max": mx,
        "clipped_frac": m["off_policy/clipped_frac"],
        "behaviour_kl": m["off_policy/behaviour_kl"],
    }
