"""Config section owned by the agent-runner role (`agent:`); `cluster.config` composes it into the run
schema."""

from __future__ import annotations

from pydantic import Field, field_validator

from kernel.strict import Strict


class AgentConfig(Strict):
    function: str | None = Field(
        None,
        description="The user's agent: 'path/to/agent.py:function' or 'dotted.module:function', an `async def "
        "agent(row, client)` (or a plain def, run in a thread with a sync client) that plays one episode with "
        "an openai client pointed at its session and returns its reward (a number), or None when the reward "
        "comes from elsewhere. None: the rollouts are not agent sessions.",
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

    @property
    def enabled(self) -> bool:
        return self.function is not None
