"""The remote reward against a real HTTP server on 127.0.0.1 (http.server in a thread)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from tiny_models import build_tokenizer

from reward_service.config import RewardConfig
from reward_service.remote import RemoteRewardClient
from reward_service.scorer import RewardScorer

TOKEN = "s3cret-token"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script: list[tuple[int, object, float]] = []  # (status, body, delay) per request; then scoring
        self.requests: list[dict] = []
        self.stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        auth = self.headers.get("Authorization")
        self.server.requests.append({"auth": auth, "body": body})
        status, reply, delay = self.server.script.pop(0) if self.server.script else (200, None, 0.0)
        if self.server.stop.wait(delay):
            return
        if auth is not None and auth != f"Bearer {TOKEN}":
            status, reply = 401, {"error": "bad token"}
        if reply is None:  # the real scoring: number of words in each response, null for empty ones
            reply = {"scores": [len(r.split()) or None for r in body["responses"]]}
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timeout test)
            pass


@pytest.fixture
def server():
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.stop.set()
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def _samples(texts: list[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    tok = build_tokenizer()
    prompts = [np.array(tok.encode("the movie"), dtype=np.int64) for _ in texts]
    return prompts, [np.array(tok.encode(t) + [tok.eos_token_id], dtype=np.int64) for t in texts]


def _scorer(tiny_policy_dir, url: str, **kw) -> RewardScorer:
    cfg = RewardConfig(kind="remote", url=url, retry_backoff_s=0.05, **kw)
    return RewardScorer(cfg, str(tiny_policy_dir))


def test_happy_path_with_bearer_token(server, tiny_policy_dir, monkeypatch):
    monkeypatch.setenv("REWARD_API_TOKEN", TOKEN)
    scorer = _scorer(tiny_policy_dir, server.url, batch_size=2)
    out = scorer.score(
        *_samples(["was great", "bad", "very very fun ."]), meta=[{"i": np.int64(i)} for i in range(3)]
    )
    assert out.ok.all() and out.scores.tolist() == [2.0, 1.0, 4.0]
    assert len(server.requests) == 2  # batches of 2 + 1
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in server.requests)
    first = server.requests[0]["body"]
    assert first == {
        "prompts": ["the movie"] * 2,
        "responses": ["was great", "bad"],
        "meta": [{"i": 0}, {"i": 1}],
    }


def test_loopback_without_token_env_sends_no_auth(server, tiny_policy_dir, monkeypatch):
    monkeypatch.delenv("REWARD_API_TOKEN", raising=False)
    out = _scorer(tiny_policy_dir, server.url).score(*_samples(["great", ""]))
    assert server.requests[0]["auth"] is None
    assert out.ok.tolist() == [True, False] and out.scores[0] == 1.0
    assert "null" in out.errors[1]  # the endpoint's null is a failed sample, not a zero


def test_non_loopback_needs_a_token(monkeypatch):
    monkeypatch.delenv("MY_TOKEN", raising=False)
    with pytest.raises(ValueError, match="MY_TOKEN"):
        RemoteRewardClient("https://rewards.example.com/score", token_env="MY_TOKEN")
    monkeypatch.setenv("MY_TOKEN", " ")
    with pytest.raises(ValueError, match="empty"):
        RemoteRewardClient("http://127.0.0.1:1/score", token_env="MY_TOKEN")
    with pytest.raises(ValueError, match="http"):
        RemoteRewardClient("ftp://127.0.0.1/score")


def test_401_is_reported_and_not_retried(server, tiny_policy_dir, monkeypatch):
    monkeypatch.setenv("REWARD_API_TOKEN", "wrong")
    out = _scorer(tiny_policy_dir, server.url, max_retries=3).score(*_samples(["great", "bad"]))
    assert not out.ok.any() and np.isnan(out.scores).all()
    assert all("HTTP 401" in e and "bad token" in e for e in out.errors)
    assert "wrong" not in out.errors[0]  # the token never leaks into messages
    assert len(server.requests) == 1


def test_500_then_200_is_retried(server, tiny_policy_dir, monkeypatch):
    monkeypatch.setenv("REWARD_API_TOKEN", TOKEN)
    server.script = [(500, {"error": "overloaded"}, 0.0)]
    out = _scorer(tiny_policy_dir, server.url, max_retries=2).score(*_samples(["great fun"]))
    assert out.ok.all() and out.scores.tolist() == [2.0]
    assert len(server.requests) == 2


def test_persistent_503_gives_up_after_bounded_retries(server, tiny_policy_dir, monkeypatch):
    monkeypatch.setenv("REWARD_API_TOKEN", TOKEN)
    server.script = [(503, {"error": "down"}, 0.0)] * 5
    out = _scorer(tiny_policy_dir, server.url, max_retries=2).score(*_samples(["great"]))
    assert not out.ok.any() and "after 3 attempt(s)" in out.errors[0] and "HTTP 503" in out.errors[0]
    assert len(server.requests) == 3


def test_slow_server_times_out_in_bounded_time(server, tiny_policy_dir, monkeypatch):
    monkeypatch.setenv("REWARD_API_TOKEN", TOKEN)
    server.script = [(200, None, 30.0)] * 2
    scorer = _scorer(tiny_policy_dir, server.url, timeout_s=0.3, max_retries=1)
    start = time.monotonic()
    out = scorer.score(*_samples(["great"]))
    elapsed = time.monotonic() - start
    assert not out.ok.any() and "timed out" in out.errors[0]
    assert elapsed < 5.0  # 2 attempts x 0.3 s + 0.05 s backoff, with slack for a busy machine
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    "reply,needle",
    [
        ({"scores": [1.0]}, "returned 1 scores for 2 samples"),
        ({"score": [1.0, 2.0]}, "without a 'scores' list"),
        ([1.0, 2.0], "without a 'scores' list"),
        ({"scores": [1.0, "high"]}, "non-number score 'high'"),
        (b"<html>oops</html>", "did not answer JSON"),
    ],
)
def test_wrong_shape_fails_the_batch(server, tiny_policy_dir, monkeypatch, reply, needle):
    monkeypatch.setenv("REWARD_API_TOKEN", TOKEN)
    server.script = [(200, reply, 0.0)]
    out = _scorer(tiny_policy_dir, server.url, max_retries=2).score(*_samples(["great", "bad"]))
    assert not out.ok.any() and np.isnan(out.scores).all()
    assert all(needle in e for e in out.errors)
    assert len(server.requests) == 1  # a bad answer is not retried
