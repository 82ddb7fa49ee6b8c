"""Config section owned by the agent-runner role (`agent:`); `cluster.config` composes it into the run
schema."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kernel.strict import Strict


class AgentConfig(Strict):
    function: str | None = Field(
        None,
        description="The user's agent: 'path/to/agent.py:function' or 'dotted.module:function', an `async def "
        "agent(row, client)` (or a plain def, run in a thread with a sync client) that plays one episode with "
        "an openai client pointed at its session and returns its reward (a number), or None when the reward "
        "comes from elsewhere. None: the rollouts are not agent sessions.",
    )
    runners: Literal["actors", "external"] = Field(
        "actors",
        description="Who plays the episodes. 'actors': agent runner actors run `function`. 'external': agents "
        "outside the cluster that only speak HTTP claim them from the workers' gateways (`POST /sessions/claim`, "
        "listed in the run folder's gateways.json; `python -m agent_runners.external` is one such agent).",
    )
    source: str | None = Field(
        None,
        description="The text of a .py `function` file, filled in by the cluster (runners on any node run it).",
    )
    model_name: str = Field(
        "policy",
        description="The model name the gateway serves the policy under (what the agent sends as `model`).",
    )
    num_runners: int = Field(1, ge=1, description="Agent runner actors (a role of their own).")
    sessions_per_runner: int = Field(
        32, ge=1, description="Episodes one runner plays at once (asyncio tasks)."
    )
    num_cpus: float = Field(0.25, ge=0.0, description="CPUs each runner actor holds.")
    timeout_s: float = Field(
        120.0,
        gt=0.0,
        description="An episode's deadline: past it the agent is cancelled and its session fails (timeout).",
    )
    train_failed: bool = Field(
        False,
        description="Train on what a failed or timed-out session captured (its reward: the one reported, else "
        "0). False: such sessions are dropped and counted (env errors), never trained.",
    )

    @field_validator("function")
    @classmethod
    def _names_a_function(cls, value: str | None) -> str | None:
        if value is not None and (":" not in value or not value.rsplit(":", 1)[1].isidentifier()):
            raise ValueError(f"give 'path/to/agent.py:function' or 'dotted.module:function', got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_player(self) -> AgentConfig:
        if self.runners == "external" and self.function is not None:
            raise ValueError(
                f"agent.runners='external' with agent.function={self.function!r}: external agents play the "
                "episodes, so no runner would run it; drop agent.function or set agent.runners='actors'"
            )
        return self

    @property
    def enabled(self) -> bool:
        """Whether the rollouts are agent sessions (played by the runner actors or by external agents)."""
        return self.function is not None or self.runners == "external"

    @property
    def actors(self) -> int:
        """How many runner actors the run starts."""
        return self.num_runners if self.function is not None else 0
