"""The tests' own Redis is really their own: when another server takes its port first, it starts on another
port instead of answering with that server's data (two test runs at once shared one Redis and emptied each
other's keys mid-test)."""

from __future__ import annotations

import pytest
import redis

from bench import redis_deployments
from bench.redis_deployments import RedisServer
from poolgate.procs import free_port


def test_a_taken_port_is_not_mistaken_for_our_server(monkeypatch: pytest.MonkeyPatch) -> None:
    other = RedisServer()
    ports = iter([other.port, free_port()])
    monkeypatch.setattr(redis_deployments, "free_port", lambda: next(ports))
    ours = RedisServer()
    try:
        assert ours.port != other.port
        client = redis.Redis(port=ours.port)
        assert client.info("server")["process_id"] == ours.proc.pid
        client.close()
    finally:
        ours.stop()
        other.stop()
