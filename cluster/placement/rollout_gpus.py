"""Where a rollout worker runs, and the engine settings only the run as a whole knows.

- `hf`, or `vllm` with `tensor_parallel_size` 1: one actor holding `num_cpus_per_worker` CPUs,
  `num_gpus_per_worker` GPUs (fractions allowed) and `resources`, in its bundle of the run's
  placement plan (`cluster.placement`).
- `vllm` with `tensor_parallel_size` = tp > 1 on GPUs (`num_gpus_per_worker` = tp, checked by the
  config): the actor is a 0-GPU wrapper placed in bundle 0 of its own placement group of tp
  `{"GPU": 1}` bundles on one node (STRICT_PACK; bundle 0 also holds its CPUs and `resources`), with `placement_group_capture_child_tasks`. vLLM's
  Ray executor finds that group (`ray.util.get_current_placement_group()`, handed on to its engine
  process) and starts one GPU worker per bundle inside it, so the GPUs are reserved once, not by
  the wrapper and again by vLLM. A replacement worker reuses its slot's group; the groups are
  created with the run's placement plan (`cluster.placement`) and removed with it.
- `vllm` on CPU (no GPUs) with tp > 1: vLLM's `mp` executor forks its workers inside the actor,
  which holds `num_cpus_per_worker` CPUs for all of them.

`max_model_len` (the KV cache vLLM reserves per sequence) defaults to the longest prompt plus the
longest response, `data.max_prompt_tokens + sampling.max_new_tokens`, instead of the model's whole
context (32k-128k tokens on real models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config.schema import RunConfig
from cluster.prompts.chat import template_kwargs
from rollout_workers.config import RolloutConfig
from rollout_workers.engines import ENGINES


def worker_config(cfg: RunConfig) -> RolloutConfig:
    """The rollout section a worker is started with: the engine's sequence limit filled in from the data
    (`Engine.fit_length`: vLLM's `max_model_len`), an
    unset `sleep_level` 1 where the roles are colocated on GPUs (the engine frees its memory for the
    learner step: vLLM sleep mode), `interruptible` from pipeline.partial_rollout, the text of an
    environment module given as a .py file, and for chat observations the prompts' template and kwargs
    (`data.tools` as schemas)."""
    r = cfg.rollout
    if cfg.pipeline.partial_rollout:
        r = r.model_copy(update={"interruptible": True})
    on_gpus = cfg.cluster.placement == "colocated" and cfg.learner.num_gpus_per_rank > 0
    if "sleep_level" not in r.model_fields_set and on_gpus:
        r = r.model_copy(update={"sleep_level": 1})
    env = r.environment
    if env.module and env.module.endswith(".py") and env.module_source is None:
        # the file's text travels with the config: workers on any node run it without the file
        source = Path(env.module)
        if not source.is_file():
            raise ValueError(f"rollout.environment.module: file {env.module!r} does not exist")
        r = r.model_copy(update={"environment": env.model_copy(update={"module_source": source.read_text()})})
    # chat observations and agent sessions are rendered with the prompts' template and kwargs
    # (data.chat_template / _kwargs, data.tools as their JSON schemas: the workers never import the tools)
    if env.observation_format == "chat" and env.chat_template is None:
        env = _with_prompts_template(env, cfg)
        r = r.model_copy(update={"environment": env})
    if cfg.agent.enabled and r.gateway.chat_template is None:
        r = r.model_copy(update={"gateway": _with_prompts_template(r.gateway, cfg)})
    if r.lora_sync == "adapter":  # room for the learner's adapters (vLLM: max_lora_rank)
        r = ENGINES[r.engine].fit_adapters(r, cfg.learner.lora.rank)
    longest = cfg.longest_episode if cfg.episodes else cfg.data.max_prompt_tokens + r.sampling.max_new_tokens
    return ENGINES[r.engine].fit_length(r, longest)


def _with_prompts_template(section: Any, cfg: RunConfig) -> Any:
    """`section` (with `chat_template` and `chat_template_kwargs` fields) given the prompts' template."""
    update: dict = {"chat_template_kwargs": template_kwargs(cfg.data)}
    if cfg.data.chat_template_file:
        update["chat_template"] = Path(cfg.data.chat_template_file).read_text(encoding="utf-8")
    return section.model_copy(update=update)


class RolloutPlacement:
    """The placement groups of workers whose engine spans several GPUs (`Engine.devices`: vLLM's tensor
    parallelism), one per worker slot (the other workers are bundles of the run's placement plan,
    `cluster.placement`)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.rollout = cfg.rollout
        self.config = worker_config(cfg)
        self.groups: dict[int, Any] = {}

    @property
    def tensor_parallel_on_gpus(self) -> bool:
        r = self.rollout
        return ENGINES[r.engine].devices(r) > 1 and r.num_gpus_per_worker > 0

    def bundles(self) -> list[dict[str, float]]:
        """One worker's group: the wrapper's CPUs (and custom resources) with the first GPU."""
        r = self.rollout
        first = {"GPU": 1.0, "CPU": r.num_cpus_per_worker, **r.resources}
        return [first] + [{"GPU": 1.0} for _ in range(ENGINES[r.engine].devices(r) - 1)]

    def group(self, slot: int) -> Any:
        if slot not in self.groups:
            self.groups[slot] = placement_group(self.bundles(), strategy="STRICT_PACK")
        return self.groups[slot]

    def options(self, slot: int) -> dict[str, Any]:
        r = self.rollout
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group(slot),
            placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True,
        )
        extra = {"resources": dict(r.resources)} if r.resources else {}
        return {"num_cpus": r.num_cpus_per_worker, "num_gpus": 0, "scheduling_strategy": strategy, **extra}
