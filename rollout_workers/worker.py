"""RolloutWorker: one engine, the policy version it holds, and the samples it returns.

A plain class; `cluster/` runs it as a Ray actor with `ray.remote(RolloutWorker)`. Loading weights
and generating never overlap: one holder uses the engine at a time (`WeightGate`, also when the
worker is used from threads or a threaded actor). Without `config.interruptible` a load waits for the
generate call to end, so every token of a sample comes from the version the sample is tagged with.
With it (`pipeline.partial_rollout`: loads arrive on a concurrency group of their own while a
generate call runs), a load cuts in at the engine's next interruption point, the sequences continue
with the new weights, and each token carries the version that sampled it (`Sample.token_versions`);
the sample's `policy_version` is its oldest token's.

Sleep (colocated with the learner): `sleep()` before the learner's step frees the engine's device
memory at `config.sleep_level`, `wake_up()` takes it back; then `load_weights` (required after a
level-2 sleep) and `generate`. The contract is `RolloutEngine`'s; the worker adds the lock and counts.

Seeding policy: the engine gets the caller's `seed` unchanged, so a chunk of prompts handed again
(for example to another worker after a failure) with the same seed and weights gives the same samples.

The contract prompts and outputs are held to is `rollout_workers.generation_contract`'s; the weights
held and each load's acknowledgement are `rollout_workers.held_weights`'.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rollout_workers.config import RolloutConfig, SamplingConfig
from rollout_workers.engine import GenerationOutput, RolloutEngine, derive_seed
from rollout_workers.engines import ENGINES
from rollout_workers.environments import make_environment
from rollout_workers.episodes import EpisodeRunner
from rollout_workers.generation_contract import check_outputs, check_prompt
from rollout_workers.held_weights import HeldWeights
from rollout_workers.types import Sample, WeightAck
from rollout_workers.weight_gate import WeightGate
from rollout_workers.weights import sampled_digest

_MAX_SEED = 2**63 - 1


def make_engine(model_path: str, config: RolloutConfig) -> RolloutEngine:
    """The engine `config.engine` names (registered in `rollout_workers.engines`), loaded from `model_path`."""
    return ENGINES.function(config.engine)(model_path, config)


def make_episode_runner(engine, model_path: str, config, environment=None) -> EpisodeRunner | None:
    """The multi-turn runner of `config` (a `rollout.environment` section), or None when it names none;
    `environment` (e.g. one whose episodes run in other processes) replaces the one `config` builds here."""
    if not config.enabled:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    if environment is None:
        environment = make_environment(config.name, config.module, config.kwargs, config.module_source)
    return EpisodeRunner(engine, tokenizer, config, environment)


def version_tags(versions: np.ndarray | None, held: int) -> tuple[int, np.ndarray | None]:
    """A sample's (`policy_version`, `token_versions`) from the version of each of its tokens: the oldest
    token's version, and the tokens' versions unless they all have it (None, the record's convention).
    `versions` None (no load could cut in): every token is `held`'s, the version the call started with."""
    if versions is None or not len(versions):
        return held, None
    oldest = int(versions.min())
    return oldest, None if (versions == oldest).all() else versions


class _CutIn:
    """The `Interrupt` a generate call hands its engine: a weight load waiting at the worker's gate is
    due; `swap` lets it run. A load that fails part-way leaves the weights unknown: the call fails
    then, rather than sample from them."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker

    @property
    def version(self) -> int:
        return self.worker._weights.version

    def due(self) -> bool:
        return self.worker._gate.load_due()

    def swap(self) -> None:
        self.worker._gate.let_loads_in()
        self.worker._engine._require_ready()


class RolloutWorker:
    def __init__(
        self,
        model_path: str,
        config: RolloutConfig,
        worker_index: int = 0,
        initial_version: int = 0,
        environment: Any = None,
        agents: Any = None,
    ) -> None:
        if initial_version < 0:
            raise ValueError(f"initial_version must be >= 0, got {initial_version}")
        self.config = config
        self.worker_index = worker_index
        self.model_path = str(model_path)
        self._engine = make_engine(str(model_path), config)
        self._episodes = make_episode_runner(self._engine, str(model_path), config.environment, environment)
        # what the engine holds (`rollout.lora_sync='adapter'`: loads carry a LoRA adapter alone)
        self._weights = HeldWeights(self._engine, config.lora_sync == "adapter", initial_version)
        self._gate = WeightGate()
        self._ready = threading.Event()  # set while awake (the gateway's calls wait for it)
        self._ready.set()
        self._gateway = None  # rollout_workers.gateway.server.GatewayServer once started
        self._gateway_seeds = (derive_seed(worker_index, 2**40), itertools.count())
        self._agents = agents  # the agent runners (`rollout_workers.agent_sessions.Agents`), or None
        self._agent_counts: collections.Counter = collections.Counter()
        self._stats = {
            "generate_calls": 0,
            "prompts": 0,
            "samples": 0,
            "tokens": 0,
            "weight_loads": 0,
            "generate_s": 0.0,
            "load_s": 0.0,
            "sleeps": 0,
            "wakes": 0,
            "sleep_s": 0.0,
            "wake_s": 0.0,
        }

    def generate(
        self,
        prompt_indices: list[int],
        prompts: list[np.ndarray],
        seed: int,
        sampling: SamplingConfig | None = None,
        texts: list[str] | None = None,
        metas: list[dict] | None = None,
        messages: list[list[dict] | None] | None = None,
    ) -> list[Sample]:
        """`n` samples per prompt (prompt order, then sample index), each tagged with the version of its
        oldest token (`version_tags`): the version held, unless a load cut in before its first token.

        `prompt_indices[i]` is the caller's id for `prompts[i]`; `sampling` overrides the config's. With
        an environment (`config.environment`) each sample is a multi-turn episode: `texts` (default: the
        decoded prompts) and `metas` (default: empty) are what the environment's `reset` receives. With
        agent runners (`agents`) each sample is an agent session on this worker's gateway, the agent given
        the row {'messages' (chat data: `messages`) or 'prompt' (text), and `metas`' columns}
        (`rollout_workers.agent_sessions`).
        """
        sampling = sampling or self.config.sampling
        if len(prompt_indices) != len(prompts):
            raise ValueError(f"{len(prompt_indices)} prompt indices but {len(prompts)} prompts")
        if not 0 <= int(seed) <= _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        if not prompts:
            return []
        ids = [self._check_prompt(idx, p, sampling) for idx, p in zip(prompt_indices, prompts, strict=True)]
        if self._agents is not None:
            return self._play_agents(prompt_indices, ids, int(seed), sampling, texts, metas, messages)
        with self._gate.hold():
            t0 = time.perf_counter()
            version = self._weights.version
            cut_in = _CutIn(self) if self.config.interruptible else None
            if self._episodes is None:
                outputs = self._engine.generate(ids, sampling, int(seed), interrupt=cut_in)
                self._check_outputs(outputs, len(ids), sampling)
                results = [
                    [(o.response_ids, o.logprobs, o.finish_reason, None, o.versions, o.routing) for o in outs]
                    for outs in outputs
                ]
            else:
                texts = (
                    texts
                    if texts is not None
                    else [self._episodes.tokenizer.decode(p, skip_special_tokens=True) for p in ids]
                )
                metas = metas if metas is not None else [{} for _ in ids]
                episodes = self._episodes.run(
                    ids, texts, metas, sampling, int(seed), self._check_outputs, cut_in
                )
                results = [
                    [
                        (r, lp, "stop" if e.status == "done" else "length", e, vs, None)
                        for r, lp, e, vs in outs
                    ]
                    for outs in episodes
                ]
            samples = []
            for idx, p, outs in zip(prompt_indices, ids, results, strict=True):
                for k, (r, lp, finish, episode, vs, routing) in enumerate(outs):
                    policy_version, token_versions = version_tags(vs, version)
                    samples.append(
                        Sample(
                            prompt_index=int(idx),
                            prompt_ids=p,
                            response_ids=r,
                            logprobs=lp,
                            finish_reason=finish,
                            policy_version=policy_version,
                            sample_index=k,
                            episode=episode,
                            token_versions=token_versions,
                            routing=routing,
                        )
                    )
            self._count(len(ids), len(samples), sum(len(x.response_ids) for x in samples), t0)
        return samples

    def generate_ids(
        self,
        prompts: list[np.ndarray],
        sampling: SamplingConfig,
        seed: int,
        stop_ids: frozenset[int] = frozenset(),
        limits: list[int] | None = None,
    ) -> tuple[list[list[GenerationOutput]], int]:
        """The engine's outputs for validated token-id prompts, and the version that sampled them (the
        agent gateway's engine calls: `rollout_workers.gateway`). Weights are never half loaded under a
        call (the gate); while the engine sleeps (colocated, the learner's step) the call waits for
        `wake_up` and for the weights loaded after it."""
        ids = [self._check_prompt(i, p, sampling) for i, p in enumerate(prompts)]
        while True:
            self._ready.wait()
            with self._gate.hold():
                if not self._engine.ready:
                    continue
                t0 = time.perf_counter()
                outputs = self._engine.generate(ids, sampling, int(seed), stop_ids, limits)
                self._check_outputs(outputs, len(ids), sampling, stop_ids, limits)
                tokens = sum(len(o.response_ids) for outs in outputs for o in outs)
                self._count(len(ids), len(ids) * sampling.n, tokens, t0)
                return outputs, self._weights.version

    def _count(self, prompts: int, samples: int, tokens: int, t0: float) -> None:
        """One generation's counters (`stats`): its prompts, samples, response tokens and seconds since `t0`."""
        s = self._stats
        s["generate_calls"] += 1
        s["prompts"] += prompts
        s["samples"] += samples
        s["tokens"] += tokens
        s["generate_s"] += time.perf_counter() - t0

    def set_agents(self, agents: Any) -> None:
        """Who plays this worker's episodes from its next generate call on (the runners after a
        `cluster.scale agent=K`)."""
        self._agents = agents

    def start_gateway(self, model_name: str) -> dict:
        """Serve the OpenAI-compatible gateway on `config.gateway.host:port` (`rollout_workers.gateway`)
        under `model_name`; returns {'url', 'admin_key'}. Idempotent."""
        if self._gateway is None:
            from rollout_workers.gateway.host import serve_worker

            self._gateway = serve_worker(self, model_name)
        return {"url": self._gateway.url, "admin_key": self._gateway.gateway.admin_key}

    def _play_agents(self, prompt_indices, ids, seed, sampling, texts, metas, messages) -> list[Sample]:
        """The samples of n agent sessions per prompt (`rollout_workers.agent_sessions.play`). The gateway's
        engine calls meanwhile draw their seeds from the call's `seed` in order (`gateway_seed`); which
        calls share an engine call depends on when the agents send them."""
        from rollout_workers.agent_sessions import play

        self.start_gateway(self._agents.model_name)
        self._gateway_seeds = (seed, itertools.count())
        texts = texts if texts is not None else [self._tokenizer().decode(p) for p in ids]
        metas = metas if metas is not None else [{} for _ in ids]
        messages = messages if messages is not None else [None] * len(ids)
        rows = [
            {**meta, **({"messages": m} if m is not None else {"prompt": t})}
            for t, meta, m in zip(texts, metas, messages, strict=True)
        ]
        gateway = self._gateway.gateway
        return play(
            gateway, self._gateway.url, self._agents, prompt_indices, rows, sampling.n, self._agent_counts
        )

    def _tokenizer(self) -> Any:
        return self._gateway.gateway.tokenizer

    def gateway_seed(self) -> int:
        """The seed of the gateway's next engine call: from the current generate call's seed, in order
        (before any: from the worker's index)."""
        base, counter = self._gateway_seeds
        return derive_seed(base, next(counter))

    def engine_limits(self) -> dict:
        """{'eos_ids', 'max_model_len', 'vocab_size'} of the engine (what the gateway validates against)."""
        e = self._engine
        return {"eos_ids": e.eos_token_ids, "max_model_len": e.max_model_len, "vocab_size": e.vocab_size}

    def take_sessions(self, session_ids: list[str]) -> list[Sample]:
        """The training samples of ended gateway sessions (each taken once)."""
        return self._gateway.gateway.take(session_ids)

    def load_weights(self, state: dict[str, torch.Tensor], version: int, probe: bool = True) -> WeightAck:
        """Load a weight bundle tagged `version` (with `rollout.lora_sync='adapter'` a LoRA adapter bundle,
        `RolloutEngine.load_adapter`); acknowledge it with what the engine now computes.

        The ack carries the digests of the bundle and of the weights held, the engine's logprobs on the
        fixed probe when `probe` (compare them with the learner's on the same weights; None otherwise)
        and, where the engine can read its weights back, their checksum at the engine dtype (compare
        with `state_checksum(bundle, engine dtype)`). Versions never go backwards.
        """
        with self._gate.hold(load=True):
            held = self._weights.version
            if version < held:
                raise ValueError(f"worker {self.worker_index} holds version {held}; refusing older {version}")
            t0 = time.perf_counter()
            engine = self._engine
            received = sampled_digest(state.items(), engine.dtype)

            def load() -> tuple[int, str]:
                (engine.load_adapter if self._weights.adapter else engine.load_weights)(state)
                return int(version), received

            return self._swap(load, t0, probe)

    def _swap(self, load: Callable[[], tuple[int, str]], t0: float, probe: bool) -> WeightAck:
        """Run `load` and acknowledge it (`HeldWeights.swap`, lock held); count it."""
        ack = self._weights.swap(load, t0, probe)
        self._sync_ready()
        self._stats["weight_loads"] += 1
        self._stats["load_s"] += time.perf_counter() - t0
        return ack

    def sleep(self, level: int | None = None) -> dict:
        """Free the engine's device memory at `level` (default `config.sleep_level`; 0 does nothing).

        Returns facts to log: {'worker_index', 'asleep', 'level' (the level it sleeps at, 0 awake),
        'changed' (False when it already slept or level is 0), 'seconds'}. Asleep, the worker refuses
        `generate`, `fingerprint` and `load_weights` until `wake_up()`; its version stays the same.
        """
        level = self.config.sleep_level if level is None else int(level)
        return self._change_sleep("sleep", lambda: level != 0 and self._engine.sleep(level))

    def wake_up(self) -> dict:
        """Take the engine's device memory back (a no-op when awake); the same facts as `sleep`. After a
        level-2 sleep the weights must be loaded (`load_weights`, any version >= the one held) before
        `generate`."""
        return self._change_sleep("wake", self._engine.wake_up)

    def _change_sleep(self, kind: str, change: Callable[[], bool]) -> dict:
        """Run `change` under the lock; count it (`sleeps`/`wakes`, seconds) when it changed the state."""
        with self._gate.hold():
            t0 = time.perf_counter()
            changed = change()
            seconds = time.perf_counter() - t0
            self._sync_ready()
            if changed:
                self._stats[f"{kind}s"] += 1
                self._stats[f"{kind}_s"] += seconds
            return self._sleep_facts(changed, seconds)

    def _sleep_facts(self, changed: bool, seconds: float) -> dict:
        level = self._engine.sleep_level
        return {
            "worker_index": self.worker_index,
            "asleep": level > 0,
            "level": level,
            "changed": bool(changed),
            "seconds": seconds,
        }

    def _sync_ready(self) -> None:
        (self._ready.set if self._engine.ready else self._ready.clear)()

    def weight_receivers(self) -> int:
        """How many ranks of the learner's weight group this worker's engine takes (`join_weight_group`)."""
        return self._engine.weight_receivers

    def join_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
    ) -> None:
        """Join learner rank 0's weight group (`cluster.weights.collective.CollectiveWeightSync`) with ranks
        `first_rank ..` (one per process holding the engine's weights)."""
        with self._gate.hold(load=True):
            self._engine.join_weight_group(host, port, first_rank, world_size, timeout_s, backend)

    def receive_weights(self, probe: bool = True) -> WeightAck:
        """Load the next broadcast bundle bucket by bucket (`RolloutEngine.receive_weights`) and
        acknowledge it as `load_weights` does."""
        with self._gate.hold(load=True):
            return self._swap(
                lambda: self._engine.receive_weights(self._weights.version), time.perf_counter(), probe
            )

    def fingerprint(self) -> WeightAck:
        """The same acknowledgement for the weights held now, without loading anything."""
        with self._gate.hold():
            return self._weights.fingerprint()

    def version(self) -> int:
        return self._weights.version

    def checksum(self) -> str | None:
        """Checksum of the weights held now (at the engine dtype; see `rollout_workers.weights`), or None
        where the engine cannot read its weights back (vLLM: use `fingerprint`)."""
        with self._gate.hold():
            return self._weights.checksum()

    def ping(self) -> str:
        return f"rollout worker {self.worker_index} ({self._engine.name}) pid {os.getpid()} on {socket.gethostname()}"

    def stats(self) -> dict:
        """Counters since start: prompts, samples and response tokens generated, weight loads, sleeps and
        wake-ups, busy seconds; and whether the engine sleeps now (`sleep_level`, 0 awake). With an
        environment: `env_busy_s` (seconds inside environment calls, summed over calls) and `env_wait_s`
        (seconds the worker waited for them: calls of one turn run at once), `env_late_answers` (calls
        that answered after their deadline: a reset's state is then closed) and `env_late_close_errors`."""
        s = dict(self._stats)
        s["busy_s"] = s["generate_s"] + s["load_s"] + s["sleep_s"] + s["wake_s"]
        s["loads_inside_generation"] = self._gate.cut_ins
        s.update(self._agent_counts)
        if self._episodes is not None:
            caller = self._episodes.caller
            s.update(
                env_busy_s=caller.busy_s,
                env_wait_s=caller.waited_s,
                env_late_answers=caller.late,
                env_late_close_errors=caller.late_close_errors,
            )
        s.update(
            worker_index=self.worker_index,
            engine=self._engine.name,
            policy_version=self._weights.version,
            sleep_level=self._engine.sleep_level,
        )
        return s

    def _check_prompt(self, index: int, prompt: np.ndarray, sampling: SamplingConfig) -> np.ndarray:
        """`prompt` checked against the engine's limits (`generation_contract.check_prompt`)."""
        budget = None if self._episodes is None else self.config.environment.max_total_tokens
        engine = self._engine
        return check_prompt(index, prompt, sampling, engine.vocab_size, engine.max_model_len, budget)

    def _check_outputs(
        self,
        outputs: list[list[GenerationOutput]],
        n_prompts: int,
        sampling: SamplingConfig,
        stop_ids: frozenset[int] = frozenset(),
        limits: list[int] | None = None,
    ) -> None:
        """The engine's outputs held to the contract (`generation_contract.check_outputs`)."""
        check_outputs(self._engine, outputs, n_prompts, sampling, stop_ids, limits)
