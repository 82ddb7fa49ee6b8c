"""The run schema: each role's own section composed with the run-level ones, loaded from YAML.

Every field is typed, has its default here and a one-line description; unknown keys and wrong
types are rejected with the dotted path of the field (`ConfigError`, exit code 2 in the CLI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from agent_runners.config import AgentConfig
from cluster.config.data_section import DataSection
from cluster.config.resolved import (
    Resolved,
    off_policy,
    optimizer_steps,
    reference_source,
    resolve,
    stale,
)
from cluster.config.sections import (
    CheckpointSection,
    ClusterSection,
    EvalSection,
    ModelSection,
    PipelineSection,
    RunSection,
    TimeoutSection,
    _Strict,
)
from learner.config import LearnerConfig
from learner.registry import ADVANTAGES, OFF_POLICY
from reward_service.backends import REWARD_KINDS
from reward_service.config import ReferenceConfig, RewardConfig
from rollout_workers.config import RolloutConfig
from rollout_workers.engines import ENGINES

RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class ConfigError(ValueError):
    """A config that cannot run; the message names the field or file."""


class RunConfig(_Strict):
    run: RunSection = Field(default_factory=RunSection, description="Run-level settings.")
    model: ModelSection = Field(..., description="Policy and tokenizer.")
    data: DataSection = Field(..., description="Prompt data.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout workers.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward scorer.")
    reference: ReferenceConfig = Field(
        default_factory=ReferenceConfig, description="Frozen reference policy."
    )
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="DeepSpeed learner.")
    cluster: ClusterSection = Field(default_factory=ClusterSection, description="Ray cluster connection.")
    timeouts: TimeoutSection = Field(default_factory=TimeoutSection, description="Remote call timeouts.")
    checkpoint: CheckpointSection = Field(
        default_factory=CheckpointSection, description="Checkpoints and resume."
    )
    pipeline: PipelineSection = Field(
        default_factory=PipelineSection, description="Synchronous or streaming (async) data plane."
    )
    eval: EvalSection = Field(
        default_factory=EvalSection, description="Held-out evaluation during training (off without prompts)."
    )
    agent: AgentConfig = Field(
        default_factory=AgentConfig,
        description="Agent runners: the user's own agent plays every rollout through the workers' OpenAI-compatible "
        "gateway (off unless agent.function is set or agent.runners is 'external'; docs/agents.md).",
    )

    @property
    def episodes(self) -> bool:
        """Whether samples are multi-turn episodes: an environment's, or the agent sessions'."""
        return self.rollout.environment.enabled or self.agent.enabled

    @property
    def longest_episode(self) -> int:
        """The most tokens an episode holds, prompt included (`rollout.environment.max_total_tokens`, or for
        agent sessions `rollout.gateway.max_total_tokens`)."""
        env = self.rollout.environment
        return env.max_total_tokens if env.enabled else self.rollout.gateway.max_total_tokens

    @model_validator(mode="after")
    def _combinations(self) -> RunConfig:
        samples = self.data.prompts_per_step * self.rollout.sampling.n
        per_rank = samples // self.learner.num_ranks
        if per_rank < 1:
            raise ValueError(
                f"learner.num_ranks={self.learner.num_ranks} is more than the {samples} samples per step "
                "(data.prompts_per_step x rollout.sampling.n)"
            )
        if self.learner.num_minibatches > per_rank:
            raise ValueError(
                f"learner.num_minibatches={self.learner.num_minibatches} makes minibatches smaller than one "
                f"sample: each rank gets {per_rank} samples per step"
            )
        if ADVANTAGES[self.learner.advantage].groups and self.rollout.sampling.n < 2:
            raise ValueError(
                f"learner.advantage={self.learner.advantage!r} takes its baseline from the other samples of "
                "the same prompt: set rollout.sampling.n >= 2"
            )
        ds = self.data.dynamic_sampling
        if ds.enabled and self.rollout.sampling.n < 2:
            raise ValueError(
                f"data.dynamic_sampling.filter={ds.filter!r} compares the rewards of a prompt's samples: set "
                "rollout.sampling.n >= 2, or data.dynamic_sampling.filter='none'"
            )
        if self.pipeline.partial_rollout and self.pipeline.mode != "async":
            raise ValueError(
                "pipeline.partial_rollout=true loads new weights into a worker while it generates, which only "
                "pipeline.mode='async' publishes: set pipeline.mode='async' or pipeline.partial_rollout=false"
            )
        self._environment()
        self._overlong()
        self._lr_schedule()
        self._reference_source()
        self._lora_sync()
        if self.learner.router_replay == "R3" and not self.rollout.record_routing:
            raise ValueError(
                "learner.router_replay='R3' replays the experts the engine chose: set rollout.record_routing=true "
                "(hf engine, a mixture-of-experts policy), or learner.router_replay='R2' (the learner's own "
                "proximal routing)"
            )
        corrects = ADVANTAGES[self.learner.advantage].corrects_off_policy
        if stale(self) and off_policy(self) == "none" and not corrects:  # 'auto' is 'tis' there
            corrections = ", ".join(repr(n) for n in OFF_POLICY.names() if n != "none")
            raise ValueError(
                f"pipeline.mode='async' with pipeline.max_staleness={self.pipeline.max_staleness} trains on samples "
                f"from older policies: set learner.off_policy to one of {corrections} (the PPO ratio is "
                "taken against the learner's proximal policy; this corrects for the behaviour policy), or "
                "pipeline.max_staleness=0"
            )
        if (missing := self.reward.missing()) is not None:
            raise ValueError(missing)
        if (
            self.reward.function_timeout_s is not None
            and self.reward.function_timeout_s >= self.timeouts.score_s
        ):
            raise ValueError(
                f"reward.function_timeout_s={self.reward.function_timeout_s:g} must be below timeouts.score_s="
                f"{self.timeouts.score_s:g} (the whole scoring call's deadline), or a hung reward function is "
                "found as a stuck scorer instead of by name: lower it or raise timeouts.score_s"
            )
        return self

    def _environment(self) -> None:
        """Multi-turn rollouts: what they need of the other sections."""
        env = self.rollout.environment
        if REWARD_KINDS[self.reward.kind].turn_rewards and not self.episodes:
            raise ValueError(
                "reward.kind='environment' scores multi-turn episodes by their environment or agent: set "
                "rollout.environment.name, agent.function or agent.runners='external', or another reward.kind"
            )
        if env.enabled and self.agent.enabled:
            raise ValueError(
                "rollout.environment.name and agent.function both set who plays the episodes: keep one"
            )
        if self.agent.enabled and self.pipeline.partial_rollout:
            raise ValueError(
                "pipeline.partial_rollout=true with agent.function: a session's calls already carry each token's "
                "version, and weights load between calls; set pipeline.partial_rollout=false"
            )
        if not self.episodes:
            return
        where = "rollout.environment" if env.enabled else "rollout.gateway"
        if self.data.max_prompt_tokens >= self.longest_episode:
            raise ValueError(
                f"data.max_prompt_tokens={self.data.max_prompt_tokens} leaves no room for a model turn within "
                f"{where}.max_total_tokens={self.longest_episode}"
            )
        if self.learner.overlong.buffer > 0 or self.learner.overlong.filter:
            raise ValueError(
                "learner.overlong.buffer / overlong.filter shape single-turn responses by their length; with "
                f"multi-turn episodes use {where}.max_total_tokens and missing_eos_penalty "
                "(an episode the environment did not end counts as truncated) instead"
            )
        if self.learner.truncation == "bootstrap":
            # The bootstrap value is V at the state after the episode's last model token. In an episode
            # that state is always followed by observation tokens, which carry no value target, so the
            # critic is never trained there; the state the next action would see (after the environment's
            # observation) is not in the sample at all.
            raise ValueError(
                "learner.truncation='bootstrap' with rollout.environment.name set would bootstrap every episode "
                "cut at max_turns / max_total_tokens from a value the critic is never trained on (the state "
                "after a turn's last token is followed by observation tokens): set learner.truncation='terminal', "
                "or unset rollout.environment.name (single responses)"
            )

    def _overlong(self) -> None:
        """The overlong ramp ends where the workers cut responses: rollout.sampling.max_new_tokens."""
        le, max_new = self.learner, self.rollout.sampling.max_new_tokens
        if le.overlong.max_tokens is not None and le.overlong.max_tokens != max_new:
            raise ValueError(
                f"learner.overlong.max_tokens={le.overlong.max_tokens} differs from rollout.sampling.max_new_tokens="
                f"{max_new}, where the workers cut responses: leave it unset (null)"
            )
        if le.overlong.buffer > max_new:
            raise ValueError(
                f"learner.overlong.buffer={le.overlong.buffer} must be <= rollout.sampling.max_new_tokens={max_new}"
            )

    def _lr_schedule(self) -> None:
        """The LR schedule spans the run: run.steps x ppo_epochs x num_minibatches optimizer steps, the
        slots its clock counts (learner.lr_schedule), unless learner.lr_schedule_steps is set."""
        le = self.learner
        if le.lr_schedule_steps is not None:
            return
        total = optimizer_steps(self)
        if le.lr_schedule != "constant" and le.warmup_steps >= total:
            raise ValueError(
                f"learner.warmup_steps={le.warmup_steps} must be less than the run's {total} optimizer steps "
                f"(run.steps x learner.ppo_epochs x learner.num_minibatches = {self.run.steps} x {le.ppo_epochs} "
                f"x {le.num_minibatches}): learner.lr_schedule={le.lr_schedule!r} decays after the warm-up"
            )

    def _reference_source(self) -> None:
        """reference.source checked as resolved ('auto' decided: cluster.config.resolved), which the learner
        is handed as learner.reference_from_base."""
        ref, lora, source = self.reference, self.learner.lora.rank, reference_source(self)
        if source == "policy_base":
            if lora == 0:
                raise ValueError(
                    "reference.source='policy_base' is the policy's base weights with the LoRA adapters off: it "
                    "needs learner.lora.rank > 0 (or reference.source='actors')"
                )
            if ref.model_path is not None:
                raise ValueError(
                    f"reference.source='policy_base' uses the policy's own base weights, but reference.model_path="
                    f"{ref.model_path!r} names another model: set reference.source='actors'"
                )
        if self.learner.reference_from_base and source != "policy_base":
            raise ValueError(
                "learner.reference_from_base is set by the cluster from reference.source: set "
                "reference.source='policy_base' instead"
            )

    def _lora_sync(self) -> None:
        """rollout.lora_sync checked; the learner is handed it as learner.export_adapter (cluster.config.resolved)."""
        ro, le = self.rollout, self.learner
        if le.export_adapter and ro.lora_sync != "adapter":
            raise ValueError(
                "learner.export_adapter is set by the cluster from rollout.lora_sync: set "
                "rollout.lora_sync='adapter' instead"
            )
        if ro.lora_sync == "adapter" and le.lora.rank == 0:
            raise ValueError(
                "rollout.lora_sync='adapter' pushes the LoRA adapter alone: it needs learner.lora.rank > 0 "
                "(or rollout.lora_sync='merged')"
            )
        if ro.lora_sync == "adapter":  # checked here, filled into the workers' section by the cluster
            ENGINES[ro.engine].fit_adapters(ro, le.lora.rank)

    @model_validator(mode="after")
    def _colocated(self) -> RunConfig:
        """What cluster.placement='colocated' cannot do, named with the field to change."""
        if self.cluster.placement != "colocated":
            if self.rollout.sleep_level:
                raise ValueError(
                    f"rollout.sleep_level={self.rollout.sleep_level} frees the engine's memory for a learner on the "
                    "same devices: it needs cluster.placement='colocated' (set 0 with 'separate')"
                )
            return self
        ranks = self.learner.num_ranks
        problems = [
            (self.pipeline.mode != "sync", "pipeline.mode='async' (the roles take turns in one process)"),
            (
                self.rollout.weight_sync != "object_store",
                "rollout.weight_sync='collective' (weights move in memory)",
            ),
            (
                ENGINES[self.rollout.engine].devices(self.rollout) > 1
                and self.rollout.num_gpus_per_worker > 0,
                "rollout.vllm.tensor_parallel_size > 1 on GPUs (an engine of its own placement group)",
            ),
            *(
                (
                    count > ranks,
                    f"{name}={count} > learner.num_ranks={ranks} (replica i lives on learner rank i)",
                )
                for name, count in (
                    ("rollout.num_workers", self.rollout.num_workers),
                    ("reference.num_replicas", self.reference.num_replicas),
                    ("reward.num_replicas", self.reward.num_replicas),
                )
            ),
            *(
                (bool(amounts), f"{name} (roles run where the learner ranks run: use learner.resources)")
                for name, amounts in (
                    ("rollout.resources", self.rollout.resources),
                    ("reference.resources", self.reference.resources),
                    ("reward.resources", self.reward.resources),
                )
            ),
        ]
        bad = [text for hit, text in problems if hit]
        if bad:
            raise ValueError(
                "cluster.placement='colocated' does not allow " + "; ".join(bad) + " (or use 'separate')"
            )
        return self

    @model_validator(mode="after")
    def _role_resources(self) -> RunConfig:
        """Custom resources: positive amounts, and never the ones Ray sets through num_cpus/num_gpus."""
        by_field = {
            "learner.resources": self.learner.resources,
            "rollout.resources": self.rollout.resources,
            "reference.resources": self.reference.resources,
            "reward.resources": self.reward.resources,
        }
        for field, amounts in by_field.items():
            for name, amount in amounts.items():
                if name in RAY_BUILTIN_RESOURCES:
                    raise ValueError(
                        f"{field}: {name!r} is set by the role's num_cpus/num_gpus fields; custom resources "
                        f"name node types, e.g. {{'{field.split('.')[0]}_node': 1}}"
                    )
                if not amount > 0:
                    raise ValueError(f"{field}.{name}: must be > 0 (got {amount})")
        return self

    @property
    def resolved(self) -> Resolved:
        """The values this run derives from the config ('auto' decided, unset lengths filled in) and the
        sections the learner ranks and reference actors are started with: cluster.config.resolved. The
        config itself keeps what the user wrote."""
        return resolve(self)

    @property
    def tokenizer_path(self) -> str:
        return self.model.tokenizer_path or self.model.policy_path

    @property
    def reference_path(self) -> str:
        return self.reference.model_path or self.model.policy_path

    @property
    def scorer_reward(self) -> RewardConfig:
        """The reward section as the scorers are given it: reward.function_timeout_s resolved (unset: half
        of timeouts.score_s), in a copy: the user's config keeps what they wrote."""
        if self.reward.function_timeout_s is not None:
            return self.reward
        return self.reward.model_copy(update={"function_timeout_s": self.timeouts.score_s / 2})


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` overrides; values are parsed as YAML scalars (so 3, 1e-4, true, null work)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. learner.lr=1e-5")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"--set {item!r}: empty key")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return tree


def field_path(loc: tuple) -> str:
    """A field's dotted path, list positions in brackets: reward.functions[1].weight."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "<root>"


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = field_path(e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"  {path}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def build_config(tree: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return build_config(apply_overrides(tree, overrides or []))
