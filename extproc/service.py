"""The ext_proc gRPC servicer: a protocol adapter over a per-stream request state machine.

Envoy opens one stream per HTTP request and sends request headers, then (BUFFERED) the whole body. The
adapter turns each message into a call on the stream's ``RequestState``; what the request is and where it
goes lives in that state, never in protocol fields. Nothing on this path raises into gRPC: a client
mistake is an ``ApiError`` answer, an unexpected exception is a logged 500 answer and a metric.

When Ready workers exist but none has room (``NoCapacity``), the request is held rather than sent to a full
worker: extproc first asks Envoy for a longer message timeout, then re-picks whenever capacity may have
changed (a request here ended, the fleet snapshot was refreshed, or a short poll), for at most
``scheduling.max_wait_s``; then it answers 429 with Retry-After. The pick itself stays pure; the waiting
lives here. A later priority queue replaces this first-come-first-tried wait.
"""

from __future__ import annotations

import asyncio
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
from extproc.affinity import AffinityMap
from extproc.errors import ApiError
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.request import RequestFacts, RequestHead, parse_head, parse_request
from extproc.reservations import Reservation, ReservationBook
from extproc.scheduling import Decision, NoCapacity, PickContext, PickRequest, RequestProfiler, Scheduler
from extproc.snapshot import FleetSnapshot
from poolgate.config import SchedulingSettings

log = logging.getLogger(__name__)

DECISION_HEADER = "x-poolgate-decision"
HOLD_TIMEOUT_MARGIN_S = 2.0
"""Asked of Envoy on top of ``max_wait_s``, so the final answer (placed or 429) always arrives in time."""
HOLD_POLL_S = 0.1
"""A held request re-picks at least this often even when no change was announced."""


class SnapshotSource(Protocol):
    @property
    def snapshot(self) -> FleetSnapshot: ...


class Phase(enum.Enum):
    HEADERS = "awaiting headers"
    BODY = "awaiting body"
    HELD = "held for capacity"
    DONE = "answered"


class RequestState:
    """One HTTP request as seen by extproc: what was asked, what was decided, what must be released."""

    __slots__ = ("body", "decision", "facts", "head", "held_worker", "hold_started", "phase", "request",
                 "reservation")

    def __init__(self) -> None:
        self.phase = Phase.HEADERS
        self.head: RequestHead | None = None
        self.body = bytearray()
        self.facts: RequestFacts | None = None
        self.request: PickRequest | None = None
        self.decision: Decision | None = None
        self.held_worker: str | None = None
        """Worker whose in-flight count this request holds until its stream ends."""
        self.reservation: Reservation | None = None
        """KV and prefill this request reserves on its worker until its stream ends."""
        self.hold_started: float | None = None


class CapacitySignal:
    """Wakes held requests when capacity may have changed; each ``notify`` wakes every current waiter."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        event = self._event
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass


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
        settings: SchedulingSettings | None = None,
        profiler: RequestProfiler | None = None,
        capacity_changed: CapacitySignal | None = None,
    ) -> None:
        settings = settings or SchedulingSettings()
        self._scheduler = scheduler
        self._fleet = fleet
        self._inflight = inflight
        self._max_request_bytes = max_request_bytes
        self._metrics = metrics
        self._clock = clock
        """Wall clock, the one worker records are stamped with (reservations compare against it)."""
        self._timer = timer
        """Monotonic timer for durations and hold deadlines."""
        self._profiler = profiler or RequestProfiler(settings)
        self._max_wait_s = settings.max_wait_s
        self._debug_header = settings.debug_header
        self.reservations = ReservationBook(settings.reservation_settle_s)
        self.affinity = AffinityMap(settings.affinity_max_entries)
        self.capacity_changed = capacity_changed or CapacitySignal()
        """Notified when a request here ends and (wired by ``serve``) when the fleet snapshot is refreshed."""
        self._settled_for: FleetSnapshot | None = None

    async def Process(
        self, request_iterator: AsyncIterator[ProcessingRequest], context: Any
    ) -> AsyncIterator[ProcessingResponse]:
        state = RequestState()
        self._metrics.open_streams.inc()
        try:
            async for message in request_iterator:
                yield self.handle(state, message)
                if state.phase is Phase.HELD:
                    yield await self.hold(state)
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

    async def hold(self, state: RequestState) -> ProcessingResponse:
        """Re-pick a request that found no capacity until it is placed or ``max_wait_s`` has passed; the
        answer is the routed body or a 429. Never raises (a cancelled stream cancels it, which is fine)."""
        started = state.hold_started if state.hold_started is not None else self._timer()
        deadline = started + self._max_wait_s
        outcome = "cancelled"  # the client went away (Envoy reset the stream) while held
        self._metrics.held_requests.inc()
        try:
            answer: ProcessingResponse | None = None
            while answer is None and (remaining := deadline - self._timer()) > 0:
                await self.capacity_changed.wait(min(remaining, HOLD_POLL_S))
                answer = self._place(state, may_hold=True)
            if answer is None:
                answer = self._place(state, may_hold=False)
            assert answer is not None
            outcome = "placed" if state.decision is not None else "refused"
            return answer
        except Exception:
            log.exception("extproc failed while holding a request (answered 500)")
            self._metrics.internal_errors.inc()
            outcome = "refused"
            return self._reject(state, errors.internal_error())
        finally:
            self._metrics.held_requests.dec()
            self._metrics.hold_seconds.labels(outcome).observe(self._timer() - started)

    def finish(self, state: RequestState) -> None:
        """The stream ended (Envoy closes it when the HTTP request is done): release what it holds."""
        released = False
        if state.held_worker is not None:
            self._inflight.release(state.held_worker)
            state.held_worker = None
            released = True
        if state.reservation is not None:
            self.reservations.release(state.reservation)
            state.reservation = None
            released = True
        if released:
            self.capacity_changed.notify()

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
        state.request = self._profiler.profile(facts)
        answer = self._place(state, may_hold=self._max_wait_s > 0)
        if answer is not None:
            return answer
        state.phase = Phase.HELD
        state.hold_started = self._timer()
        return answers.extend_timeout(self._max_wait_s + HOLD_TIMEOUT_MARGIN_S)

    def pick_context(self) -> PickContext:
        """The current snapshot with this replica's accounting; settles reservations on a new snapshot."""
        snapshot = self._fleet.snapshot
        if snapshot is not self._settled_for:
            self.reservations.settle(snapshot)
            self._settled_for = snapshot
        reservations = self.reservations
        return PickContext(snapshot, self._inflight.counts, reservations.kv_tokens, reservations.prefill_tokens,
                           self.affinity.entries)

    def _place(self, state: RequestState, may_hold: bool) -> ProcessingResponse | None:
        """Pick and answer; None when there is no capacity now and the request may be held."""
        request = state.request
        assert request is not None
        started = self._timer()
        outcome = self._scheduler.pick(request, self.pick_context())
        self._metrics.pick_seconds.observe(self._timer() - started)
        if isinstance(outcome, Decision):
            return self._commit(state, request, outcome)
        if isinstance(outcome, NoCapacity):
            if may_hold:
                return None
            self._metrics.pick_refusals.labels(request.model, outcome.reason).inc()
            waited = 0.0 if state.hold_started is None else self._timer() - state.hold_started
            return self._reject(state, errors.no_capacity(request.model, waited, outcome.retry_after_s))
        if outcome.code != "model_not_found":  # a client's unknown model names must not become label values
            self._metrics.pick_refusals.labels(request.model, outcome.code or outcome.type).inc()
        return self._reject(state, outcome)

    def _commit(self, state: RequestState, request: PickRequest, decision: Decision) -> ProcessingResponse:
        state.phase = Phase.DONE
        state.decision = decision
        worker_id = decision.worker_id
        self._inflight.acquire(worker_id)
        state.held_worker = worker_id
        state.reservation = self.reservations.reserve(worker_id, request.prompt_tokens, request.output_tokens,
                                                      self._clock())
        if request.affinity_keys:
            self.affinity.record(request.affinity_keys, worker_id)
        self._metrics.picks.labels(decision.pool, worker_id).inc()
        self._metrics.requests.labels("routed").inc()
        extra = ((DECISION_HEADER, describe(decision, request)),) if self._debug_header else ()
        return answers.routed_body(decision, request.facts.client_routing_headers, extra)

    def _reject(self, state: RequestState, error: ApiError) -> ProcessingResponse:
        state.phase = Phase.DONE
        self._metrics.requests.labels(error.code or error.type).inc()
        return answers.error_answer(error)


def describe(decision: Decision, request: PickRequest) -> str:
    """The debug header's value: where the request went, what it was estimated to need, and why."""
    scores = " ".join(f"{name}={score:.3f}" for name, score in decision.scores)
    return (f"worker={decision.worker_id} pool={decision.pool} class={request.task_class} "
            f"prompt_tokens={request.prompt_tokens} output_tokens={request.output_tokens} {scores}").rstrip()


def _continue_other(kind: str | None) -> ProcessingResponse:
    """Phases the filter is not configured to send; answer them neutrally so Envoy never waits."""
    if kind == "response_headers":
        return ProcessingResponse(response_headers=HeadersResponse())
    if kind == "response_body":
        return ProcessingResponse(response_body=BodyResponse())
    if kind == "response_trailers":
        return ProcessingResponse(response_trailers=TrailersResponse())
    raise RuntimeError(f"unexpected ext_proc message {kind!r}")
