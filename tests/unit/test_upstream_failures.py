"""Which of Envoy's upstream log entries count against which worker."""

from __future__ import annotations

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from controller.xds.upstream_failures import failures_by_worker

WORKERS = {("10.0.0.1", 8000): "w1", ("10.0.0.2", 8000): "w2"}


def entry(host: str, port: int, status: int = 0, **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    log = accesslog_pb2.HTTPAccessLogEntry()
    log.common_properties.upstream_remote_address.socket_address.address = host
    log.common_properties.upstream_remote_address.socket_address.port_value = port
    for name, value in flags.items():
        setattr(log.common_properties.response_flags, name, value)
    if status:
        log.response.response_code.value = status
    return log


def worker_at(host: str, port: int) -> str | None:
    return WORKERS.get((host, port))


@pytest.mark.parametrize(("log", "counted"), [
    (entry("10.0.0.1", 8000, 500), True),
    (entry("10.0.0.1", 8000, 503), True),
    (entry("10.0.0.1", 8000, 200), False),
    (entry("10.0.0.1", 8000, 429), False),
    (entry("10.0.0.1", 8000, upstream_connection_failure=True), True),
    (entry("10.0.0.1", 8000, 200, upstream_connection_termination=True), True),  # died mid-stream
    (entry("10.0.0.1", 8000, upstream_remote_reset=True), True),
    (entry("10.0.0.1", 8000, 504, upstream_request_timeout=True), True),
    (entry("10.0.0.1", 8000, upstream_overflow=True), False),  # Envoy's own circuit breaker, not the worker
    (entry("10.0.0.9", 8000, 500), False),  # no worker there (gone since)
    (entry("", 0, 503, no_healthy_upstream=True), False),  # no worker was tried
])
def test_an_entry_counts_against_its_worker_when_the_worker_failed(log: accesslog_pb2.HTTPAccessLogEntry,
                                                                   counted: bool) -> None:
    assert failures_by_worker([log], worker_at) == ({"w1": 1} if counted else {})


def test_failures_add_up_per_worker() -> None:
    logs = [entry("10.0.0.1", 8000, 500), entry("10.0.0.2", 8000, 502), entry("10.0.0.1", 8000, 500),
            entry("10.0.0.2", 8000, 200)]
    assert failures_by_worker(logs, worker_at) == {"w1": 2, "w2": 1}
