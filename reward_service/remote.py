"""A reward scored by a remote HTTP endpoint (a judge model, a sandbox running unit tests, ...).

Protocol: POST JSON `{"prompts": [str], "responses": [str], "meta": [dict]}`, answer
`{"scores": [float | null, ...]}` with one entry per sample (null = the endpoint could not score it).
Standard library only, so the scorer actor needs nothing extra installed.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from reward_service.config import RewardConfig

# Statuses worth another try: server errors, plus "too many requests" and "request timeout".
_RETRY_STATUS = {408, 429}


class RemoteRewardError(RuntimeError):
    """One request (one batch of samples) to the remote reward could not be completed."""


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"meta value of type {type(x).__name__} is not JSON-serialisable")


class RemoteRewardClient:
    """POSTs batches with bounded retries; every failure raises `RemoteRewardError` naming the cause."""

    def __init__(
        self,
        url: str,
        token_env: str = "REWARD_API_TOKEN",
        timeout_s: float = 30.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.5,
    ) -> None:
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise ValueError(f"reward.url must be an http(s) URL with a host, got {url!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.retry_backoff_s = float(retry_backoff_s)
        token = os.environ.get(token_env)
        if token is None and not is_loopback(url):
            raise ValueError(
                f"remote reward {url} needs a bearer token in environment variable {token_env} "
                "(only a loopback URL may be used without one)"
            )
        if token is not None and not token.strip():
            raise ValueError(f"environment variable {token_env} is set but empty; unset it or give the token")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token.strip()}"
        # A loopback endpoint must never be reached through an http_proxy from the environment.
        handlers = [urllib.request.ProxyHandler({})] if is_loopback(url) else []
        self._opener = urllib.request.build_opener(*handlers)

    @classmethod
    def from_config(cls, config: RewardConfig) -> RemoteRewardClient:
        if not config.url:
            raise ValueError("reward.kind='remote' needs reward.url")
        return cls(config.url, config.token_env, config.timeout_s, config.max_retries, config.retry_backoff_s)

    def score(
        self, prompts: list[str], responses: list[str], meta: list[dict[str, Any]]
    ) -> list[float | None]:
        """One score per sample (None where the endpoint returned null); raises RemoteRewardError."""
        n = len(prompts)
        if len(responses) != n or len(meta) != n:
            raise ValueError(f"{n} prompts, {len(responses)} responses, {len(meta)} meta entries")
        try:
            body = json.dumps(
                {"prompts": prompts, "responses": responses, "meta": meta}, default=_json_default
            ).encode()
        except (TypeError, ValueError) as e:
            raise RemoteRewardError(f"cannot encode the request as JSON: {e}") from e
        payload = self._post(body)
        return self._parse(payload, n)

    def _post(self, body: bytes) -> bytes:
        last = ""
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(self.url, data=body, headers=self._headers, method="POST")
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    return resp.read()
            except urllib.error.HTTPError as e:
                detail = e.read(300).decode("utf-8", "replace").strip()
                last = f"HTTP {e.code} {e.reason}: {detail}"
                if e.code < 500 and e.code not in _RETRY_STATUS:
                    raise RemoteRewardError(f"remote reward {self.url} refused the request: {last}") from None
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}"
        raise RemoteRewardError(
            f"remote reward {self.url} failed after {attempts} attempt(s); last error: {last}"
        )

    def _parse(self, payload: bytes, n: int) -> list[float | None]:
        try:
            data = json.loads(payload)
        except ValueError as e:
            raise RemoteRewardError(f"remote reward {self.url} did not answer JSON: {e}") from None
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list):
            raise RemoteRewardError(
                f"remote reward {self.url} answered without a 'scores' list: {str(data)[:200]}"
            )
        if len(scores) != n:
            raise RemoteRewardError(f"remote reward {self.url} returned {len(scores)} scores for {n} samples")
        out: list[float | None] = []
        for i, s in enumerate(scores):
            if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))):
                raise RemoteRewardError(f"remote reward {self.url} returned a non-number score {s!r} at {i}")
            out.append(None if s is None else float(s))
        return out
