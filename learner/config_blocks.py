"""The parameter blocks of the learner's section that are sections of their own: the KL penalty
(`learner.kl`: its estimators, coefficient and controller), the policy loss's ratio clip
(`learner.clip`), DAPO's overlong shaping (`learner.overlong`), the LoRA adapters (`learner.lora`), and
the blocks the registered parts declare (`part_blocks`: `learner.gae`, `learner.vtrace`, `learner.grpo`,
`learner.tis`, `learner.mask`, `learner.geo_mask`, `learner.rollout_correction`, read from the
registries)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from kernel.registry import Part, Registry, resolve
from kernel.strict import Strict as _Strict
from learner.registry import ADVANTAGES, KL_ESTIMATORS, OFF_POLICY

# The learner fields that select one registered part, with the registry of their parts: a part that
# declares a parameter block (`Part.section`) gets the field learner.<part.block_field> (its name, unless
# it names another), read (and allowed) only when learner.<field> selects it, and required then when the
# part says so (`Part.section_required`).
SELECTING: dict[str, Registry[Any]] = {"advantage": ADVANTAGES, "off_policy": OFF_POLICY}

# Fields of the learner's section that moved into a block: a config naming one is refused with the new
# place (an old name is never read).
MOVED = {
    "lam": "learner.gae.lam (advantage gae) and learner.vtrace.lam (advantage vtrace)",
    "group_std_normalize": "learner.grpo.norm_adv_by_std",
    "vtrace_rho_clip": "learner.vtrace.rho_clip",
    "vtrace_c_clip": "learner.vtrace.c_clip",
    "off_policy_cap": "learner.tis.cap (off_policy tis) and learner.mask.cap (off_policy mask)",
    "off_policy_geo_bounds": "learner.geo_mask.bounds (off_policy geo_mask)",
    "overlong_buffer": "learner.overlong.buffer",
    "overlong_penalty": "learner.overlong.penalty",
    "overlong_max_tokens": "learner.overlong.max_tokens",
    "overlong_filter": "learner.overlong.filter",
    "clip_eps": "learner.clip.eps",
    "clip_eps_high": "learner.clip.eps_high",
    "dual_clip": "learner.clip.dual",
}


def _with_block(name: str) -> Part | None:
    """The registered part `name` (of a registry in SELECTING) when it declares a block, else None."""
    for registry in SELECTING.values():
        if name in registry and registry[name].section is not None:
            return registry[name]
    return None


def part_blocks() -> dict[str, tuple[Any, Any]]:
    """learner.<block field> for each registered part that declares a parameter block, in registration
    order: its model (or None, unset: the part's defaults, or refused when the part requires its block)
    and the description (the model's docstring). Two parts' blocks under one field are an error."""
    fields: dict[str, tuple[Any, Any]] = {}
    for field, registry in SELECTING.items():
        for part in registry:
            key = part.block_field
            if key is None:
                continue
            if key in fields:
                raise ValueError(f"learner.{key}: two registered parts declare a block of that name")
            model = resolve(part.section)
            about = " ".join((model.__doc__ or "").split())
            unset = "required by it" if part.section_required else "unset: the defaults below"
            fields[key] = (
                model | None,
                Field(
                    None,
                    description=f"{about} Read (and allowed) only with learner.{field}: {part.name}; {unset}.",
                ),
            )
    return fields


def block_of(cfg: BaseModel, name: str) -> BaseModel | None:
    """The parameter block of the registered part `name` in the learner section `cfg`: as set, else its
    defaults; None for a part that declares none."""
    part = _with_block(name)
    if part is None:
        return None
    block = getattr(cfg, part.block_field)
    return resolve(part.section)() if block is None else block


def check_part_blocks(cfg: BaseModel) -> None:
    """A part's block set while another part is selected is refused, naming the field that selects it; a
    selected part that requires its block refuses its absence, naming the block and its fields."""
    for field, registry in SELECTING.items():
        chosen = getattr(cfg, field)
        for part in registry:
            key = part.block_field
            if key is None:
                continue
            block = getattr(cfg, key)
            if part.name != chosen and block is not None:
                raise ValueError(
                    f"learner.{key} is read only with learner.{field}: {part.name} (got {field}="
                    f"{chosen!r}); set {field}: {part.name}, or drop the block"
                )
            if part.name == chosen and block is None and part.section_required:
                names = ", ".join(resolve(part.section).model_fields)
                raise ValueError(f"learner.{field}={chosen!r} needs learner.{key} ({names})")


def refuse_moved(data: Any) -> None:
    """A learner section (as loaded) naming a field that moved into a block: a ValueError naming the new
    place of the first (in name order)."""
    moved = sorted(data.keys() & MOVED.keys()) if isinstance(data, dict) else []
    if moved:
        raise ValueError(f"learner.{moved[0]} moved to {MOVED[moved[0]]}")


KLName = Literal[KL_ESTIMATORS.names()]  # the registered KL estimators (learner.registry)


class KLConfig(_Strict):
    estimator: KLName = Field(
        "k1", description=f"Per-token KL estimator in the shaped reward: {KL_ESTIMATORS.describe()}."
    )
    coef: float = Field(0.05, ge=0.0, description="Initial (or fixed) KL coefficient beta.")
    adaptive: bool = Field(False, description="Adapt beta towards `target` (Ziegler et al. 2019).")
    target: float = Field(6.0, gt=0.0, description="Target KL per sequence for the adaptive controller.")
    horizon: int = Field(10000, ge=1, description="Adaptive controller horizon in samples.")
    mode: Literal["reward", "loss"] = Field(
        "reward",
        description=(
            "'reward': -coef * KL_t (by `estimator`) in every token's reward; 'loss': the reward carries no "
            "KL and loss_coef * KL (by `loss_estimator`, gradient through log pi) is added to the loss."
        ),
    )
    loss_coef: float = Field(0.001, ge=0.0, description="KL loss coefficient (mode='loss').")
    loss_estimator: KLName = Field(
        "k3",
        description="Per-token KL estimator of the loss term (mode='loss'); the values as for `estimator`.",
    )

    @model_validator(mode="after")
    def _check(self) -> KLConfig:
        if self.mode == "loss" and self.adaptive:
            raise ValueError("kl.adaptive controls the in-reward coefficient: it needs kl.mode='reward'")
        return self


class ClipConfig(_Strict):
    """learner.clip: the ratio clip every registered policy loss reads (learner.losses.Clip): the ratio r
    kept in [1 - eps, 1 + eps_high], and with a loss whose entry takes a dual clip (learner.registry
    POLICY_LOSSES, `dual_clip`) a negative advantage's loss capped at -dual * A. verl's actor
    clip_ratio_low (or clip_ratio), clip_ratio_high and clip_ratio_c."""

    eps: float = Field(
        0.2,
        gt=0.0,
        description="Lower ratio clip, r >= 1 - eps, and the upper one unless eps_high (verl's clip_ratio_low).",
    )
    eps_high: float | None = Field(
        None,
        gt=0.0,
        description="Upper ratio clip, r <= 1 + eps_high (asymmetric clipping, DAPO's clip-higher); None = eps "
        "(verl's clip_ratio_high).",
    )
    dual: float | None = Field(
        None,
        gt=1.0,
        description="Dual-clip constant c > 1: a negative advantage's loss is capped at -c * A (Ye et al. 2020); "
        "None = off (verl's clip_ratio_c, on there at 3.0 by default). Only with a policy_loss that has a "
        "clipped branch to cap.",
    )


class OverlongConfig(_Strict):
    """learner.overlong: DAPO's overlong reward shaping (its soft punishment) and overlong filtering."""

    buffer: int = Field(
        0,
        ge=0,
        description=(
            "DAPO soft overlong punishment, B tokens: a response of L tokens (EOS included) with "
            "L_max - B < L <= L_max (L_max = max_tokens) gets ((L_max - B) - L) / B * penalty added to its "
            "score, EOS or not (0 at L_max - B down to -penalty at L_max); it adds to "
            "learner.missing_eos_penalty. 0 = off."
        ),
    )
    penalty: float = Field(
        1.0,
        gt=0.0,
        description="Penalty at L = L_max of the overlong ramp (DAPO's default 1.0); used when buffer > 0.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "L_max of the overlong ramp; None: rollout.sampling.max_new_tokens (a run refuses any other "
            "value; a learner used alone needs it when buffer > 0, and a truncated sample of another "
            "length, or any longer one, stops the train step with an error naming this field)."
        ),
    )
    filter: bool = Field(
        False,
        description=(
            "DAPO overlong filtering: responses cut at max_new_tokens (no EOS) contribute no token to the "
            "loss (policy, value, entropy, KL terms), counted in train/overlong_filtered. Advantages, group "
            "baselines and whitening are computed before the filter and still see them. A minibatch left "
            "with no token takes no optimizer step."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> OverlongConfig:
        if self.max_tokens is not None and self.buffer > self.max_tokens:
            raise ValueError(
                f"learner.overlong.buffer={self.buffer} must be <= learner.overlong.max_tokens="
                f"{self.max_tokens} (the ramp starts at L_max - buffer >= 0)"
            )
        return self


class LoRAConfig(_Strict):
    rank: int = Field(
        0,
        ge=0,
        description=(
            "LoRA rank r (0 = off: full fine-tuning). With r > 0 the policy's base weights are frozen and "
            "only the adapters (and modules_to_save, and the value head where a critic is used) train; "
            "exports and final/ carry the merged weights W + B A alpha/r under the base model's names "
            "(see docs/lora.md)."
        ),
    )
    alpha: float = Field(
        16.0, gt=0.0, description="LoRA alpha: the adapter's update is scaled by alpha/rank."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input (PEFT lora_dropout); 0 keeps the policy deterministic.",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description=(
            "Linear modules that get adapters: names matched as PEFT matches them (a module's full name or "
            "its last components, e.g. ['q_proj', 'v_proj'] or ['c_attn']), or 'all-linear' (every linear "
            "layer but the output layer). A name matching no linear module is a config error listing "
            "the model's linear module names."
        ),
    )
    target_parameters: list[str] = Field(
        default_factory=list,
        description=(
            "Parameters that get adapters as parameters (PEFT target_parameters): the fused 3-D expert stacks "
            "of a mixture of experts, e.g. ['experts.gate_up_proj', 'experts.down_proj'] (one rank-r adapter "
            "per expert; see docs/moe.md), matched as PEFT matches them (a parameter's full name or its last "
            "components). A name matching no parameter is a config error listing the model's 3-D parameters. "
            "Exported merged like the modules' adapters; not with rollout.lora_sync: adapter."
        ),
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description=(
            "Modules trained in full beside the adapters (PEFT modules_to_save, e.g. ['wpe']); exported "
            "under their base names. A module tied to another (tied embeddings) is refused."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty: name modules or use 'all-linear'")
        return self
