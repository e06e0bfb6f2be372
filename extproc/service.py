"""The ext_proc gRPC servicer: a protocol adapter over a per-stream request state machine.

Envoy opens one stream per HTTP request and sends request headers, then (BUFFERED) the whole body. The
adapter turns each message into a call on the stream's ``RequestState``; what the request is and where it
goes lives in that state, never in protocol fields. Nothing on this path raises into gRPC: a client
mistake is an ``ApiError`` answer, an unexpected exception is a logged 500 answer and a metric.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    HeadersResponse,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)

from extproc import answers, errors
from extproc.errors import ApiError
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.request import RequestFacts, RequestHead, parse_head, parse_request
from extproc.scheduling import Decision, Scheduler
from extproc.snapshot import FleetSnapshot

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    @property
    def snapshot(self) -> FleetSnapshot: ...


class Phase(enum.Enum):
    HEADERS = "awaiting headers"
    BODY = "awaiting body"
    DONE = "answered"


class RequestState:
    """One HTTP request as seen by extproc: what was asked, what was decided, what must be released."""

    __slots__ = ("body", "decision", "facts", "head", "held_worker", "phase")

    def __init__(self) -> None:
        self.phase = Phase.HEADERS
        self.head: RequestHead | None = None
        self.body = bytearray()
        self.facts: RequestFacts | None = None
        self.decision: Decision | None = None
        self.held_worker: str | None = None
        """Worker whose in-flight count this request holds until its stream ends."""


def header_pairs(headers: HttpHeaders) -> Iterable[tuple[str, str]]:
    for header in headers.headers.headers:
        yield header.key, (header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value)


class ExtProcService(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        fleet: SnapshotSource,
        inflight: InflightTracker,
        max_request_bytes: int,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._scheduler = scheduler
        self._fleet = fleet
        self._inflight = inflight
        self._max_request_bytes = max_request_bytes
        self._metrics = metrics
        self._clock = clock
        self._timer = timer

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: Any
    ) -> AsyncIterator[ProcessingResponse]:
        state = RequestState()
        self._metrics.open_streams.inc()
        try:
            async for message in request_iterator:
                yield self.handle(state, message)
        finally:
            self.finish(state)
            self._metrics.open_streams.dec()

    def handle(self, state: RequestState, message: ProcessingRequest) -> ProcessingResponse:
        """Answer one message; never raises."""
        try:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                return self._on_headers(state, message.request_headers)
            if kind == "request_body":
                return self._on_body(state, message.request_body.body, message.request_body.end_of_stream)
            if kind == "request_trailers":
                return answers.continue_trailers()
            return _continue_other(kind)
        except Exception:
            log.exception("extproc failed on a request (answered 500)")
            self._metrics.internal_errors.inc()
            return self._reject(state, errors.internal_error())

    def finish(self, state: RequestState) -> None:
        """The stream ended (Envoy closes it when the HTTP request is done): release what it holds."""
        if state.held_worker is not None:
            self._inflight.release(state.held_worker)
            state.held_worker = None

    def _on_headers(self, state: RequestState, headers: HttpHeaders) -> ProcessingResponse:
        head = state.head = parse_head(header_pairs(headers))
        if head.content_length is not None and head.content_length > self._max_request_bytes:
            return self._reject(state, errors.body_too_large(head.content_length, self._max_request_bytes))
        if head.is_model_list:
            state.phase = Phase.DONE
            self._metrics.requests.labels("model_list").inc()
            return answers.model_list_answer(self._fleet.snapshot.models, int(self._clock()))
        if not headers.end_of_stream:
            state.phase = Phase.BODY
            return answers.continue_headers()
        if head.is_inference:
            return self._reject(state, errors.invalid_request("The request body must be a JSON object.",
                                                              code="missing_body"))
        state.phase = Phase.DONE
        self._metrics.requests.labels("passthrough").inc()
        return answers.continue_headers(head.client_routing_headers)

    def _on_body(self, state: RequestState, chunk: bytes, end_of_stream: bool) -> ProcessingResponse:
        head = state.head
        if head is None or state.phase is not Phase.BODY:
            raise RuntimeError(f"request body while {state.phase.value}")
        state.body += chunk
        if len(state.body) > self._max_request_bytes:
            return self._reject(state, errors.body_too_large(len(state.body), self._max_request_bytes))
        if not end_of_stream:
            return answers.continue_body()
        state.phase = Phase.DONE
        if not head.is_inference:
            self._metrics.requests.labels("passthrough").inc()
            return answers.continue_body(head.client_routing_headers)
        facts = parse_request(head, bytes(state.body))
        state.body = bytearray()
        if isinstance(facts, ApiError):
            return self._reject(state, facts)
        state.facts = facts
        started = self._timer()
        decision = self._scheduler.pick(facts, self._fleet.snapshot, self._inflight.counts)
        self._metrics.pick_seconds.observe(self._timer() - started)
        if isinstance(decision, ApiError):
            return self._reject(state, decision)
        state.decision = decision
        self._inflight.acquire(decision.worker_id)
        state.held_worker = decision.worker_id
        self._metrics.requests.labels("routed").inc()
        return answers.routed_body(decision, facts.client_routing_headers)

    def _reject(self, state: RequestState, error: ApiError) -> ProcessingResponse:
        state.phase = Phase.DONE
        self._metrics.requests.labels(error.code or error.type).inc()
        return answers.error_answer(error)


def _continue_other(kind: str | None) -> ProcessingResponse:
    """Phases the filter is not configured to send; answer them neutrally so Envoy never waits."""
    if kind == "response_headers":
        return ProcessingResponse(response_headers=HeadersResponse())
    if kind == "response_body":
        return ProcessingResponse(response_body=BodyResponse())
    if kind == "response_trailers":
        return ProcessingResponse(response_trailers=TrailersResponse())
    raise RuntimeError(f"unexpected ext_proc message {kind!r}")
