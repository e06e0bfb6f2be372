"""The ext_proc gRPC servicer: translates Envoy's messages into calls on the director and its outcomes back.

Envoy opens one stream per HTTP request and sends request headers, then (BUFFERED) the whole body, then, when
asked, the response headers and body. ``RequestState`` is the stream's protocol state (which message comes
next, the body received so far) around the director's record of the request. Only this module and
``answers`` know protobuf. Nothing here raises into gRPC: an unexpected exception is a logged 500 answer and
a metric (or, once the response started, the message passed on untouched).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HeadersResponse,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)

from extproc import answers
from extproc.endpoint_picker import endpoint_subset
from extproc.errors import ProtocolError
from extproc.metrics import Metrics
from extproc.pipeline import (
    Admitting,
    Director,
    ModelList,
    Passthrough,
    Placed,
    Proceed,
    Refused,
    RequestContext,
    Wait,
)
from extproc.scheduling import Decision, PickRequest
from poolgate.kernel.logging_setup import request_id

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_PENDING = ProcessingResponse()
"""Placeholder from ``handle`` while the request awaits its quota admission (never sent)."""


class Phase(enum.Enum):
    HEADERS = "awaiting headers"
    BODY = "awaiting body"
    ADMIT = "awaiting quota admission"
    HELD = "held for capacity"
    DONE = "answered"


class RequestState:
    """One stream: where the protocol is, the body received so far, and the director's record."""

    __slots__ = ("body", "context", "phase")

    def __init__(self) -> None:
        self.phase = Phase.HEADERS
        self.body = bytearray()
        self.context = RequestContext()

    @property
    def request(self) -> PickRequest | None:
        return self.context.request

    @property
    def decision(self) -> Decision | None:
        return self.context.decision


def header_pairs(headers: HttpHeaders) -> Iterable[tuple[str, str]]:
    for header in headers.headers.headers:
        yield header.key, (header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value)


class ExtProcService(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, director: Director, metrics: Metrics, header_pin: bool = False) -> None:
        self.director = director
        self._metrics = metrics
        self._header_pin = header_pin
        """Also name the picked worker in a request header (gateways routing with ORIGINAL_DST on it)."""

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: Any
    ) -> AsyncIterator[ProcessingResponse]:
        state = RequestState()
        self._metrics.open_streams.inc()
        try:
            async for message in request_iterator:
                answer = self.handle(state, message)
                if state.phase is Phase.ADMIT:
                    answer = await self.admit(state)
                yield answer
                if state.phase is Phase.HELD:
                    yield await self.hold(state)
        finally:
            self.finish(state)
            self._metrics.open_streams.dec()

    def handle(self, state: RequestState, message: ProcessingRequest) -> ProcessingResponse:
        """Answer one message; never raises. In phase ADMIT afterwards, ``admit`` gives the real answer."""
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._on_headers(state, message)
            if kind == "request_body":
                return self._on_body(state, message.request_body.body, message.request_body.end_of_stream)
            if kind == "response_headers":
                headers = message.response_headers
                rewrite = self.director.response_headers(state.context, _status(headers), headers.end_of_stream)
                if rewrite is None:
                    return answers.continue_response_headers()
                return answers.continue_response_headers(rewrite_body=True, body_watched=rewrite.body_watched)
            if kind == "response_body":
                body = message.response_body
                return answers.continue_response_body(
                    self.director.response_body(state.context, body.body, body.end_of_stream))
            if kind == "request_trailers":
                return answers.continue_trailers()
            return _continue_other(kind)
        except Exception:
            log.exception("extproc failed on a request (answered 500)")
            if state.phase is Phase.DONE and kind is not None and kind.startswith("response"):
                self._metrics.internal_errors.inc()
                return _continue_other(kind)  # the response already started: pass it on untouched
            return self._answer(state, self.director.failed(state.context))

    async def admit(self, state: RequestState) -> ProcessingResponse:
        return self._answer(state, await self.director.admit(state.context))

    async def hold(self, state: RequestState) -> ProcessingResponse:
        return self._answer(state, await self.director.hold(state.context))

    def finish(self, state: RequestState) -> None:
        self.director.finish(state.context)

    def _on_headers(self, state: RequestState, message: ProcessingRequest) -> ProcessingResponse:
        headers = message.request_headers
        _bind_request_id(headers)
        outcome = self.director.headers(state.context, header_pairs(headers), endpoint_subset(message),
                                        headers.end_of_stream)
        if isinstance(outcome, Proceed):
            state.phase = Phase.BODY
            return answers.continue_headers(watch_response=outcome.watch_response_body,
                                            watch_response_headers=outcome.watch_response_headers)
        if isinstance(outcome, Passthrough):
            state.phase = Phase.DONE
            return answers.continue_headers(outcome.remove)
        return self._answer(state, outcome)

    def _on_body(self, state: RequestState, chunk: bytes, end_of_stream: bool) -> ProcessingResponse:
        if state.phase is not Phase.BODY:
            raise ProtocolError(f"request body while {state.phase.value}")
        oversized = self.director.body_received(state.context, len(state.body) + len(chunk))
        if oversized is not None:
            return self._answer(state, oversized)
        if not end_of_stream:
            state.body += chunk
            return answers.continue_body()
        state.phase = Phase.DONE
        # BUFFERED sends the whole body in one message: use it as it is (a 1 MB prompt costs two copies less).
        raw = bytes(state.body + chunk) if state.body else chunk
        state.body = bytearray()
        outcome = self.director.body(state.context, raw)
        if isinstance(outcome, Passthrough):
            return answers.continue_body(outcome.remove)
        return self._answer(state, outcome)

    def _answer(self, state: RequestState, outcome: Placed | Refused | Wait | Admitting | ModelList) -> (
            ProcessingResponse):
        """The one translation of an outcome into Envoy's answer (and the stream's next phase)."""
        state.phase = Phase.DONE
        if isinstance(outcome, Placed):
            return answers.routed_body(outcome.decision, outcome.remove, outcome.headers, outcome.body,
                                       header_pin=self._header_pin)
        if isinstance(outcome, Refused):
            return answers.error_answer(outcome.error)
        if isinstance(outcome, Wait):
            state.phase = Phase.HELD
            return answers.extend_timeout(outcome.timeout_s)
        if isinstance(outcome, Admitting):
            state.phase = Phase.ADMIT
            return _PENDING
        return answers.model_list_answer(outcome.cards, outcome.created)


def _status(headers: HttpHeaders) -> int | None:
    """The response's ``:status``, when it is a number."""
    for key, value in header_pairs(headers):
        if key == ":status":
            return int(value) if value.isascii() and value.isdigit() else None
    return None


def _bind_request_id(headers: HttpHeaders) -> None:
    """Tag this stream's log lines with Envoy's request id (the stream is its own task, so its own context)."""
    for key, value in header_pairs(headers):
        if key == REQUEST_ID_HEADER:
            request_id.set(value)
            return


def _continue_other(kind: str | None) -> ProcessingResponse:
    """Phases the filter is not configured to send; answer them neutrally so Envoy never waits."""
    if kind == "response_headers":
        return ProcessingResponse(response_headers=HeadersResponse())
    if kind == "response_body":
        return answers.continue_response_body()
    if kind == "response_trailers":
        return ProcessingResponse(response_trailers=TrailersResponse())
    raise ProtocolError(f"unexpected ext_proc message {kind!r}")
