"""What a rollout worker hands an agent runner, and what the runner hands back (`agent_runners`):
plain records, so that the two roles share them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

AgentStatus = Literal["done", "failed", "timeout"]


@dataclass(frozen=True)
class AgentTask:
    """One agent episode: the session the worker opened on its gateway, and the prompt row."""

    session_id: str
    api_key: str  # the session's key: the agent's client sends it as its OpenAI API key
    base_url: str  # the gateway's OpenAI base URL (ends in /v1)
    model: str  # the name the gateway serves the policy under
    row: dict[str, Any]  # the prompt row: 'messages' (chat data) or 'prompt' (text), and its other columns
    timeout_s: float


@dataclass(frozen=True)
class AgentOutcome:
    """How one episode ended on the runner: its status, the reward the agent returned (None: none; the
    session may still have one reported over HTTP), the error of a failed one, and its seconds."""

    session_id: str
    status: AgentStatus
    reward: float | None = None
    error: str | None = None
    seconds: float = 0.0
