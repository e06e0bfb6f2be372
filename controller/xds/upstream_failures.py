"""Every Envoy's failed upstream attempts, as data-path failure counts per worker in Redis.

Each Envoy's router logs an upstream attempt that failed (the worker answered 5xx, refused or dropped the
connection, or timed out) to Envoy's gRPC access log service on the xDS cluster (``controller.xds.bootstrap``),
so every controller receives the failures of the Envoys that talk to it. An entry names the worker's address;
the xDS server knows which worker Envoy was sent there. Each message Envoy flushes (every
``UPSTREAM_LOG_FLUSH_S``) becomes one pipelined write; the health monitor of the leader reads the counts
(``controller.monitor``). Nothing here is per request on the success path: Envoy sends failures only.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Protocol

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from controller.xds.bootstrap import UPSTREAM_FAILURE_FLAGS
from poolgate.kernel.outage import REDIS_ERRORS

log = logging.getLogger("poolgate.controller.upstream_failures")



class FailureSink(Protocol):
    async def record_passive_failures(self, counts: Mapping[str, int]) -> None: ...


def is_worker_failure(entry: accesslog_pb2.HTTPAccessLogEntry) -> bool:
    """The worker answered 5xx, or Envoy's flags blame it (a connect failure or reset has no status code)."""
    if entry.response.response_code.value >= 500:
        return True
    flags = entry.common_properties.response_flags
    return any(getattr(flags, name) for name in UPSTREAM_FAILURE_FLAGS.values())


def failures_by_worker(entries: Iterable[accesslog_pb2.HTTPAccessLogEntry],
                       worker_at: Callable[[str, int], str | None]) -> dict[str, int]:
    """Failed attempts per worker id; an address no worker was sent at (gone since) counts for nobody."""
    counts: dict[str, int] = {}
    for entry in entries:
        address = entry.common_properties.upstream_remote_address.socket_address
        if not address.address or not is_worker_failure(entry):
            continue
        worker_id = worker_at(address.address, address.port_value)
        if worker_id is not None:
            counts[worker_id] = counts.get(worker_id, 0) + 1
    return counts


class UpstreamFailureLog(als_pb2_grpc.AccessLogServiceServicer):
    """The access log service Envoy streams its failed upstream attempts to."""

    def __init__(self, sink: FailureSink, worker_at: Callable[[str, int], str | None]) -> None:
        self._sink = sink
        self._worker_at = worker_at

    def add_to(self, server: grpc.aio.Server) -> None:
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self, server)

    async def StreamAccessLogs(  # the generated servicer's name
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            counts = failures_by_worker(message.http_logs.log_entry, self._worker_at)
            if not counts:
                continue
            try:
                await self._sink.record_passive_failures(counts)
            except REDIS_ERRORS as exc:  # the probes still judge; a lost report only delays an ejection
                log.warning("upstream failures of %s not recorded: %s", ", ".join(sorted(counts)), exc)
        return als_pb2.StreamAccessLogsResponse()
