"""The OpenAI request bodies the gateway accepts, and its errors as OpenAI writes them.

A request is validated by pydantic; a field the gateway cannot honour is refused by name, never
ignored: an agent that asks for `top_logprobs` or a temperature the run does not train at gets a 400
that names the field and says why (`GatewayError.bad_field`). Fields OpenAI defines that do not
change what is sampled (`user`, `metadata`, `store`, `parallel_tool_calls`, `stream_options`, ...)
are accepted and have no effect; unknown fields are refused.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class GatewayError(Exception):
    """An OpenAI-shaped error: `{"error": {"message", "type", "param", "code"}}` with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def __reduce__(self):  # picklable (Ray sends a worker's exceptions to the driver)
        return (_rebuild, (self.status, self.message, self.param, self.code, self.retry_after))

    @classmethod
    def bad_field(cls, param: str, message: str, code: str = "invalid_value") -> GatewayError:
        return cls(400, f"{param}: {message}", param=param, code=code)

    @classmethod
    def from_validation(cls, error: ValidationError) -> GatewayError:
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or "body"
        return cls.bad_field(param, first["msg"])

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "server_error" if self.status >= 500 else "rate_limit_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": f"{max(1, round(self.retry_after))}"}


def _rebuild(status, message, param, code, retry_after) -> GatewayError:
    return GatewayError(status, message, param=param, code=code, retry_after=retry_after)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Body):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's wire format)


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def arguments(self) -> Any:
        """The arguments as the object they encode; a 400 naming the field when they are not JSON."""
        try:
            return json.loads(self.function.arguments)
        except json.JSONDecodeError:
            raise GatewayError.bad_field(
                "messages.tool_calls.function.arguments", f"not JSON: {self.function.arguments!r}"
            ) from None


class Message(_Body):
    """One chat message; content parts (`[{"type": "text", "text": ...}]`) are joined into their text."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # the SDK re-sends it with assistant messages

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text") for p in self.content]
            if any(
                p.get("type") != "text" or not isinstance(t, str)
                for p, t in zip(self.content, parts, strict=True)
            ):
                raise GatewayError.bad_field("messages.content", "only text content parts are served")
            return "".join(parts)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it: text content, tool call arguments as objects."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = self.text()
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.function.name, "arguments": c.arguments()}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class Sampling(_Body):
    """The sampling fields both endpoints share."""

    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool | None = None
    response_format: dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_names(self) -> list[str]:
        names = []
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if tool.get("type") != "function" or not isinstance(function, dict) or "name" not in function:
                raise GatewayError.bad_field(
                    f"tools.{i}", "a tool is {'type': 'function', 'function': {name, ...}}"
                )
            names.append(str(function["name"]))
        return names


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
