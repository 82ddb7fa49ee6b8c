"""Session lifetime in the service's config and bookkeeping, without starting it: `Service.expire`
ends only the sessions whose last heartbeat is older than `session_timeout_s`, and a timeout below
two of the SDK's heartbeats is refused by name."""

from __future__ import annotations

import pytest

KEY, MODEL = "tml-test-key", "tiny-gpt2"


def test_expire_ends_only_sessions_past_the_timeout(tiny_policy_dir):
    """Service.expire at chosen clock readings (no Ray: no session here holds an actor): a session whose
    latest heartbeat is 30 s old survives session_timeout_s = 30, one 30.5 s old ends, naming the
    setting; an ended session is not ended again; finishing one names its client."""
    from cluster.serve.config import ServeConfig
    from cluster.serve.service import Service, Session

    cfg = ServeConfig(
        api_keys=[KEY], base_models=[{"name": MODEL, "path": str(tiny_policy_dir)}], session_timeout_s=30
    )
    svc = Service(cfg)
    svc.sessions = {"a": Session(KEY, last_beat=100.0), "b": Session(KEY, last_beat=99.5)}
    assert svc.expire(130.0) == ["b"]
    assert svc.sessions["a"].ended is None
    assert svc.sessions["b"].ended == "no heartbeat for more than 30s (session_timeout_s)"
    assert svc.expire(130.0) == [] and svc.expire(130.5) == ["a"]
    svc.sessions["c"] = Session(KEY, last_beat=0.0)
    svc.end("c", "its client finished it")
    assert svc.expire(1000.0) == [] and svc.sessions["c"].ended == "its client finished it"


def test_session_timeout_s_below_two_sdk_heartbeats_is_refused_by_name():
    from pydantic import ValidationError

    from cluster.serve.config import ServeConfig

    with pytest.raises(ValidationError, match=r"session_timeout_s must be >= 20 \(got 15\): the tinker SDK"):
        ServeConfig(api_keys=[KEY], base_models=[{"name": MODEL, "path": "x"}], session_timeout_s=15)
