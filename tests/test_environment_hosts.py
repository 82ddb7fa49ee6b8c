"""The states of episodes whose environment runs elsewhere (`rollout.environment.placement: actors`): an
`EnvironmentHost` built as a plain object, as Ray builds it at each (re)start. A key from before a restart
names no episode of the fresh host: its step fails and its close frees nothing of the host's episodes.
A generate call closes every episode it started, also when it raises."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.placement.environments import EnvironmentHost
from rollout_workers.config import EnvironmentConfig, RolloutConfig, SamplingConfig
from rollout_workers.environment import Environment, register_environment
from rollout_workers.worker import RolloutWorker


def test_an_episode_begun_before_a_restart_fails_and_leaves_the_new_episodes_alone():
    config = EnvironmentConfig(name="tools")  # a turn without a tool call answers: 1.0 iff it is right
    before = EnvironmentHost(config)
    old = before.reset("2*3=", {"answer": 6})
    after = EnvironmentHost(config)  # the same actor restarted: Ray builds it again
    new = after.reset("3*4=", {"answer": 12})
    with pytest.raises(KeyError, match="restarted since the episode began"):
        after.step("12", old)  # the old episode's wrong answer, right for the new one's prompt
    after.close(old)  # the old episode ends (as a failed one): nothing of the new host's is freed
    assert after.step("12", new).reward == 1.0
    after.close(new)
    with pytest.raises(KeyError, match="closed already"):
        after.step("12", new)
    assert after.states == {}


@register_environment("test-endless")
class Endless(Environment):
    """Answers every turn and never ends an episode; its clean-up always raises."""

    def reset(self, prompt, meta):
        return {"prompt": prompt}

    def step(self, model_turn, state):
        return " the", None, False

    def close(self, state):
        raise RuntimeError("the sandbox would not shut down")


class InProcessHost(Environment):
    """`RemoteEnvironment`'s calls on one host, made in this process instead of through Ray."""

    def __init__(self, host: EnvironmentHost) -> None:
        self.host = host

    def reset(self, prompt, meta):
        return self.host.reset(prompt, meta)

    def step(self, model_turn, key):
        return self.host.step(model_turn, key)

    def close(self, key):
        self.host.close(key)


def test_a_generation_that_raises_mid_episode_leaves_no_state_in_the_host(tiny_policy_dir):
    host = EnvironmentHost(EnvironmentConfig(name="test-endless"))
    config = RolloutConfig(
        engine="hf", environment=EnvironmentConfig(name="test-endless", max_turns=4, max_total_tokens=48)
    )
    worker = RolloutWorker(str(tiny_policy_dir), config, environment=InProcessHost(host))
    real, open_at_calls = worker._engine.generate, []

    def generate(*args, **kwargs):  # the second turn's generation fails
        open_at_calls.append(len(host.states))
        if len(open_at_calls) == 2:
            raise RuntimeError("the engine lost its device")
        return real(*args, **kwargs)

    worker._engine.generate = generate
    prompts = [np.array([1, 4, 5]), np.array([1, 6, 7, 8])]
    with pytest.raises(RuntimeError, match="lost its device"):  # the call's error, not a close's
        worker.generate([0, 1], prompts, seed=1, sampling=SamplingConfig(n=2, max_new_tokens=4))
    assert open_at_calls == [4, 4]  # every episode was open when the generation raised
    assert host.states == {}
