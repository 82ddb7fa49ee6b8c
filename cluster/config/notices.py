"""Settings that are valid together but leave part of the config unused: each rule says so once at a
run's start (`cluster.train.preflight`), a `warning:` line on stderr, naming the setting to change.

A rule is a function of the run config returning its message, or None when it does not apply; `NOTICES`
holds them all."""

from __future__ import annotations

import sys
from collections.abc import Callable

from cluster.config.schema import RunConfig
from reward_service.backends import REWARD_KINDS

NOTICES: list[Callable[[RunConfig], str | None]] = []


def notice(rule: Callable[[RunConfig], str | None]) -> Callable[[RunConfig], str | None]:
    NOTICES.append(rule)
    return rule


@notice
def environment_rewards_unused(cfg: RunConfig) -> str | None:
    """Multi-turn episodes scored by another reward kind: the environment's own rewards (every turn's and
    the outcome) are dropped by design (`reward_service.scorer.ScoreBatch.turn_rewards`)."""
    env, kind = cfg.rollout.environment, cfg.reward.kind
    if REWARD_KINDS[kind].turn_rewards or not cfg.episodes:
        return None
    if cfg.agent.enabled:
        return (
            f"agent sessions with reward.kind={kind!r}: the rewards the agent returns or "
            f"reports are NOT trained; each session's reward is the reward.kind={kind!r} score of its transcript "
            "(the response is every token after the prompt: completions, tool results and glue). Set "
            "reward.kind='environment' to train on the agent's rewards."
        )
    return (
        f"rollout.environment.name={env.name!r} with reward.kind={kind!r}: the environment's rewards (each "
        f"turn's and the outcome) are NOT trained; each episode's reward is the reward.kind={kind!r} score of "
        "its transcript alone. Set reward.kind='environment' to train on the environment's rewards."
    )


def config_notices(cfg: RunConfig) -> list[str]:
    """The messages of every rule of `NOTICES` that applies to `cfg`."""
    return [m for rule in NOTICES if (m := rule(cfg)) is not None]


def announce_config(cfg: RunConfig) -> None:
    """Each of `config_notices`, a `warning:` line on stderr."""
    for line in config_notices(cfg):
        print(f"warning: {line}", file=sys.stderr, flush=True)
