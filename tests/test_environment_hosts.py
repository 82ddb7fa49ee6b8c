"""The states of episodes whose environment runs elsewhere (`rollout.environment.placement: actors`): an
`EnvironmentHost` built as a plain object, as Ray builds it at each (re)start. A key from before a restart
names no episode of the fresh host: its step fails and its close frees nothing of the host's episodes."""

from __future__ import annotations

import pytest

from cluster.placement.environments import EnvironmentHost
from rollout_workers.config import EnvironmentConfig


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
