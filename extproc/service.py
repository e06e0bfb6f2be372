"""The ext_proc gRPC servicer: a protocol adapter over a per-stream request state machine.

Envoy opens one stream per HTTP request and sends request headers, then (BUFFERED) the whole body. The
adapter turns each message into a call on the stream's ``RequestState``; what the request is and where it
goes lives in that state, never in protocol fields. Nothing on this path raises into gRPC: a client
mistake is an ``ApiError`` answer, an unexpected exception is a logged 500 answer and a metric.

Per request: identify the tenant at the headers phase (401 before the body is read); at the body, check the
model is allowed (403), then admit it against the tenant's quotas (one Redis script call, only for tenants
with limits; 429 naming the limit), then pick. When Ready workers exist but none has room (``NoCapacity``)
the request waits in the priority queue (``flow_queue``): extproc first asks Envoy for a longer message
timeout, then a release pass re-picks queued requests in the queue's order whenever capacity may have
changed (a request here ended, the fleet snapshot was refreshed, or a short poll). Past its class's deadline
the answer is 429 with Retry-After; a client that goes away leaves the queue at once. At stream end the
worker's in-flight count, the KV reservation and the quota slot are released; for tenants charged by tokens
the usage read from the response body corrects the tokens reserved at admission. With the GenAI metrics on
(``observability.genai_metrics``) every inference response's status and body pass through here as well, and
the request's duration, time to first token, time per output token and token usage are recorded at its end.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from dataclasses import replace
from typing import Any, Protocol

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HeadersResponse,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
    TrailersResponse,
)
from redis.exceptions import RedisError

from extproc import answers, errors
from extproc.affinity import AffinityMap
from extproc.catalogue import EMPTY_CATALOGUE, Catalogue, Route
from extproc.catalogue_source import CatalogueSource
from extproc.endpoint_picker import GIE_MODE, endpoint_subset, within
from extproc.errors import ApiError
from extproc.flow_queue import FlowQueue, QueueEntry
from extproc.genai import GenAiCall
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.parameters import apply_parameters
from extproc.quota import QuotaStore, QuotaTicket
from extproc.rename import ModelRenamer
from extproc.request import RequestFacts, RequestHead, facts_from_data, load_body, parse_head
from extproc.reservations import Reservation, ReservationBook
from extproc.scheduling import Decision, NoCapacity, PickContext, PickRequest, RequestProfiler, Scheduler
from extproc.snapshot import FleetSnapshot
from extproc.tenancy import Tenant, TenantDirectory
from extproc.usage import UsageWatch, with_usage_requested
from poolgate.kernel.config import ObservabilitySettings, SchedulingSettings, TenancySettings
from poolgate.kernel.logging_setup import request_id

log = logging.getLogger(__name__)

DECISION_HEADER = "x-poolgate-decision"
TENANT_HEADER = "x-poolgate-tenant"
"""Set on the upstream request: the tenant extproc identified (client copies are stripped by Envoy)."""
HOLD_TIMEOUT_MARGIN_S = 2.0
"""Asked of Envoy on top of the class's deadline, so the final answer (placed or 429) always arrives in time."""
HOLD_POLL_S = 0.1
"""Held requests are re-tried at least this often even when no change was announced."""
_REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
REQUEST_ID_HEADER = "x-request-id"
_PENDING = ProcessingResponse()
"""Placeholder from ``handle`` while the request awaits its quota admission (never sent)."""


class SnapshotSource(Protocol):
    @property
    def snapshot(self) -> FleetSnapshot: ...


class Phase(enum.Enum):
    HEADERS = "awaiting headers"
    BODY = "awaiting body"
    ADMIT = "awaiting quota admission"
    HELD = "held for capacity"
    DONE = "answered"


class RequestState:
    """One HTTP request as seen by extproc: what was asked, what was decided, what must be released."""

    __slots__ = ("body", "catalogue", "decision", "entry", "facts", "genai", "head", "held_worker", "hold_started",
                 "new_body", "phase", "renamer", "request", "reservation", "route", "subset", "tenant", "ticket",
                 "usage", "waiter", "watch_response")

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
        self.tenant: Tenant | None = None
        self.ticket: QuotaTicket | None = None
        """The tenant's quota this request holds until its stream ends."""
        self.entry: QueueEntry | None = None
        """Its place in the priority queue while it waits there."""
        self.waiter: asyncio.Future[ProcessingResponse] | None = None
        """Resolved with the final answer by a release pass (placed) or by shedding."""
        self.watch_response = False
        """The response body comes to extproc (asked at the headers phase) so its usage can be read."""
        self.usage: UsageWatch | None = None
        self.new_body: bytes | None = None
        """The request body as sent upstream, when extproc rewrote it (catalogue version, usage requested)."""
        self.catalogue: Catalogue = EMPTY_CATALOGUE
        """The catalogue current when the request arrived; a reload does not change a request in flight."""
        self.route: Route | None = None
        """The catalogue version the request was resolved to, when its public name differs from the served one."""
        self.renamer: ModelRenamer | None = None
        """Restores the public model name in the response body."""
        self.subset: frozenset[str] | None = None
        """``ip:port`` endpoints the gateway allows for this request (endpoint-picker subset hint); None = all."""
        self.genai: GenAiCall | None = None
        """What the GenAI metrics record at the stream's end (inference requests, when they are on)."""


class CapacitySignal:
    """Says capacity may have changed: wakes current waiters and calls the listeners (the release pass)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()
        for listener in self._listeners:
            listener()

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
        tenants: TenantDirectory | None = None,
        quotas: QuotaStore | None = None,
        catalogue: CatalogueSource | None = None,
        rng: random.Random | None = None,
        endpoint_picker_mode: str = "poolgate",
        observability: ObservabilitySettings | None = None,
    ) -> None:
        settings = settings or SchedulingSettings()
        self._genai_metrics = observability is not None and observability.genai_metrics
        """Watch every inference response (status and body) for the GenAI metrics. Like quotas, off unless
        wired: ``serve`` passes the configuration's ``observability`` (``genai_metrics``, off by default)."""
        self._header_pin = endpoint_picker_mode == GIE_MODE
        """Also name the picked worker in a request header (gateways routing with ORIGINAL_DST on it)."""
        self.catalogue = catalogue or CatalogueSource(EMPTY_CATALOGUE)
        self._rng = rng or random.Random()
        """Draws catalogue traffic splits."""
        self._scheduler = scheduler
        self._fleet = fleet
        self._inflight = inflight
        self._max_request_bytes = max_request_bytes
        self._metrics = metrics
        self._clock = clock
        """Wall clock, the one worker records are stamped with (reservations compare against it)."""
        self._timer = timer
        """Monotonic timer for durations and queue deadlines."""
        self._profiler = profiler or RequestProfiler(settings)
        self._debug_header = settings.debug_header
        self.tenants = tenants or TenantDirectory(TenancySettings(), ())
        tenancy = self.tenants.settings
        self._quotas = quotas
        self._quota_fail_open = tenancy.quota_fail_open
        self._reconcile = quotas is not None and tenancy.reconcile_usage
        self._max_wait_s = tuple(settings.max_wait_s if c.max_wait_s is None else c.max_wait_s
                                 for c in tenancy.priority_classes)
        self.queue = FlowQueue(self._max_wait_s, tenancy.max_queued, timer)
        self.reservations = ReservationBook(settings.reservation_settle_s)
        self.affinity = AffinityMap(settings.affinity_max_entries)
        self.capacity_changed = capacity_changed or CapacitySignal()
        """Notified when a request here ends and (wired by ``serve``) when the fleet snapshot is refreshed."""
        self.capacity_changed.subscribe(self._request_pass)
        self._settled_for: FleetSnapshot | None = None
        self._pass_pending = False
        self._last_pass = 0.0
        self._background: set[asyncio.Task[None]] = set()

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
        try:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                _bind_request_id(message.request_headers)
                state.subset = endpoint_subset(message)
                return self._on_headers(state, message.request_headers)
            if kind == "request_body":
                return self._on_body(state, message.request_body.body, message.request_body.end_of_stream)
            if kind == "response_headers":
                return self._on_response_headers(state, message.response_headers)
            if kind == "response_body":
                return self._on_response_body(state, message.response_body.body,
                                              message.response_body.end_of_stream)
            if kind == "request_trailers":
                return answers.continue_trailers()
            return _continue_other(kind)
        except Exception:
            log.exception("extproc failed on a request (answered 500)")
            self._metrics.internal_errors.inc()
            if state.phase is Phase.DONE and kind is not None and kind.startswith("response"):
                return _continue_other(kind)  # the response already started: pass it on untouched
            return self._reject(state, errors.internal_error())

    async def admit(self, state: RequestState) -> ProcessingResponse:
        """Ask Redis whether the tenant's quotas admit the request, then route it. Never raises (apart from
        the stream's cancellation, after which a slot granted meanwhile is given back)."""
        tenant, request = state.tenant, state.request
        assert tenant is not None and request is not None and self._quotas is not None
        call = asyncio.ensure_future(self._quotas.admit(tenant, request.total_tokens))
        try:
            outcome: QuotaTicket | ApiError | None = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_orphan)
            raise
        except _REDIS_ERRORS as exc:
            self._metrics.quota_errors.labels("admit").inc()
            log.warning("quota admission failed for tenant %s (%s); %s", tenant.name, exc,
                        "admitting" if self._quota_fail_open else "refusing")
            if not self._quota_fail_open:
                return self._refuse(state, errors.quota_unavailable(), "quota_unavailable")
            outcome = None
        except Exception:
            log.exception("quota admission failed (answered 500)")
            self._metrics.internal_errors.inc()
            return self._reject(state, errors.internal_error())
        if isinstance(outcome, ApiError):
            return self._refuse(state, outcome, outcome.param or outcome.code or "quota")
        state.ticket = outcome
        try:
            return self._route(state)
        except Exception:
            log.exception("extproc failed on a request (answered 500)")
            self._metrics.internal_errors.inc()
            return self._reject(state, errors.internal_error())

    async def hold(self, state: RequestState) -> ProcessingResponse:
        """Wait in the queue until a release pass places the request, it is shed, or its class's deadline
        passes (then one last pick, else 429). Never raises (a cancelled stream cancels it, which is fine:
        ``finish`` takes the request out of the queue)."""
        entry, waiter = state.entry, state.waiter
        assert entry is not None and waiter is not None
        started = entry.enqueued_at
        outcome = "cancelled"  # the client went away (Envoy reset the stream) while held
        self._metrics.held_requests.inc()
        try:
            while not waiter.done() and (remaining := entry.deadline - self._timer()) > 0:
                await asyncio.wait((waiter,), timeout=min(remaining, HOLD_POLL_S))
                if not waiter.done() and self._timer() - self._last_pass >= HOLD_POLL_S:
                    self._release_pass()
            if waiter.done():
                answer = waiter.result()
            else:
                self._dequeue(state, "refused")
                answer = self._place(state, may_hold=False) or self._reject(state, errors.internal_error())
                if state.decision is None:
                    self._count_rejection(state, "queue_deadline")
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
        if state.entry is not None:
            self._dequeue(state, "cancelled")
        if state.held_worker is not None:
            self._inflight.release(state.held_worker)
            state.held_worker = None
            released = True
        if state.reservation is not None:
            self.reservations.release(state.reservation)
            state.reservation = None
            released = True
        if state.ticket is not None:
            self._release_quota(state)
        self._record_genai(state)  # still here: the stream closed before the response's last byte
        if released:
            self.capacity_changed.notify()

    def _on_headers(self, state: RequestState, headers: HttpHeaders) -> ProcessingResponse:
        tenants = self.tenants
        head = state.head = parse_head(header_pairs(headers), tenants.settings.tenant_header,
                                       tenants.settings.trust_tenant_header)
        if self._genai_metrics and head.is_inference:
            state.genai = GenAiCall(head.path, self._timer())
        if head.content_length is not None and head.content_length > self._max_request_bytes:
            return self._reject(state, errors.body_too_large(head.content_length, self._max_request_bytes))
        if head.is_api or head.is_model_list:
            identified = tenants.identify(head.authorization, head.tenant_claim)
            if isinstance(identified, ApiError):
                return self._refuse(state, identified, "invalid_api_key")
            state.tenant = identified
        if head.is_model_list:
            state.phase = Phase.DONE
            self._metrics.requests.labels("model_list").inc()
            cards = self.catalogue.current.cards(self._fleet.snapshot.models)
            if state.tenant is not None and state.tenant.models is not None:
                cards = tuple(c for c in cards if c.id in state.tenant.models)
            return answers.model_list_answer(cards, int(self._clock()))
        if not headers.end_of_stream:
            state.phase = Phase.BODY
            tenant = state.tenant
            state.watch_response = state.genai is not None or (
                head.is_inference and self._reconcile and tenant is not None and tenant.tokens_per_minute is not None)
            state.catalogue = catalogue = self.catalogue.current
            return answers.continue_headers(
                watch_response=state.watch_response,
                watch_response_headers=head.is_inference and (catalogue.renames or state.genai is not None))
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
        raw = bytes(state.body)
        state.body = bytearray()
        data = load_body(raw)
        if isinstance(data, ApiError):
            return self._reject(state, data)
        facts = facts_from_data(head, data)
        if isinstance(facts, ApiError):
            return self._reject(state, facts)
        tenant = state.tenant
        assert tenant is not None  # identified at the headers phase
        call = state.genai
        if call is not None:
            call.stream = facts.stream
            call.request_model = facts.model
            call.model_known = facts.model in self._fleet.snapshot.models
        if not tenant.may_use(facts.model):
            return self._refuse(state, errors.model_not_allowed(facts.model), "model_not_allowed")
        route = state.catalogue.resolve(facts.model, tenant.name, self._rng)
        if call is not None and route is not None and route.adapter is None:
            call.model_known = True  # a catalogue name (any ``base:adapter`` is known once placed)
        if route is not None and route.touches_body:
            resolved = self._apply_route(state, head, data, facts, route)
            if isinstance(resolved, ApiError):
                return self._reject(state, resolved)
            facts = resolved
        state.facts = facts
        request = self._profiler.profile(facts)
        if tenant.only_pools is not None or tenant.excluded_pools:
            request = _with_pools(request, tenant)
        if route is not None and route.pool is not None:
            request = _with_version_pool(request, route.pool)
        if route is not None and route.adapter is not None:
            request = replace(request, adapter=route.adapter)
        if tenant.priority:  # the saturation gate keeps headroom for the highest class
            request = replace(request, priority=tenant.priority)
        state.request = request
        if state.watch_response:
            hide = facts.stream and not facts.include_usage
            if hide:
                state.new_body = with_usage_requested(state.new_body or raw) or state.new_body
            state.usage = UsageWatch(facts.stream, hide_usage_chunk=hide and state.new_body is not None)
        if tenant.has_quota and self._quotas is not None:
            state.phase = Phase.ADMIT
            return _PENDING
        return self._route(state)

    def _apply_route(self, state: RequestState, head: RequestHead, data: dict[str, Any], facts: RequestFacts,
                     route: Route) -> RequestFacts | ApiError:
        """Rewrite the body for the chosen version: parameter defaults and caps, then the served name."""
        changed = apply_parameters(data, route)
        if isinstance(changed, ApiError):
            return changed
        if not (changed or route.renames or route.adapter):
            return facts
        data["model"] = route.body_model
        state.new_body = orjson.dumps(data)
        if route.renames and route.adapter is None:  # an adapter's responses name the adapter, not the base
            state.route = route
        if changed:  # a default may have set max_tokens: the estimates must see it
            reparsed = facts_from_data(head, data)
            return reparsed if isinstance(reparsed, ApiError) else replace(reparsed, model=route.served_name)
        return replace(facts, model=route.served_name)

    def _on_response_headers(self, state: RequestState, headers: HttpHeaders) -> ProcessingResponse:
        """Asked while the GenAI metrics are on (the status tells a worker's error) or the catalogue renames
        models (watch the body of requests sent under another name)."""
        if state.genai is not None:
            state.genai.response_headers(_status(headers), headers.end_of_stream, self._timer())
            if headers.end_of_stream:
                self._record_genai(state)
        route = state.route
        if route is None or state.decision is None:
            return answers.continue_response_headers()
        state.renamer = ModelRenamer(route.served_name, route.public_name)
        return answers.continue_response_headers(rewrite_body=True, body_watched=state.watch_response)

    def _on_response_body(self, state: RequestState, chunk: bytes, end_of_stream: bool) -> ProcessingResponse:
        if state.genai is not None:
            state.genai.response_chunk(chunk, end_of_stream, self._timer())
        usage, renamer = state.usage, state.renamer
        replacement = usage.feed(chunk, end_of_stream) if usage is not None else None
        if renamer is not None:
            renamed = renamer.feed(chunk if replacement is None else replacement, end_of_stream)
            replacement = renamed if renamed is not None else replacement
        if end_of_stream or (state.genai is not None and state.genai.ended):
            self._record_genai(state)  # at the last byte or [DONE], with the usage it carried
        return answers.continue_response_body(replacement)

    def _record_genai(self, state: RequestState) -> None:
        """Record the request's GenAI metrics once: when its response ends, extproc answers an error itself,
        or (``finish``) its stream closes first."""
        call, usage = state.genai, state.usage
        if call is None:
            return
        state.genai = None
        call.record(self._metrics, usage.input_tokens if usage is not None else None,
                    usage.output_tokens if usage is not None else None, self._timer())

    def _route(self, state: RequestState) -> ProcessingResponse:
        """Place an admitted request now, or queue it (behind others waiting for the same capacity)."""
        tenant, request = state.tenant, state.request
        assert tenant is not None and request is not None
        self._metrics.admissions.labels(tenant.name, tenant.priority_class).inc()
        domain = (request.model, tenant.only_pools, tenant.excluded_pools)
        may_hold = self._max_wait_s[tenant.priority] > 0 and self.queue.max_entries > 0
        if not (may_hold and self.queue.has_waiting(domain)):
            answer = self._place(state, may_hold=may_hold)
            if answer is not None:
                return answer
        return self._enqueue(state, domain)

    def _enqueue(self, state: RequestState, domain: Hashable) -> ProcessingResponse:
        tenant, request = state.tenant, state.request
        assert tenant is not None and request is not None
        pushed = self.queue.push(domain, tenant.name, tenant.priority, request.total_tokens, tenant.weight, state)
        for shed in pushed.shed:
            self._shed(shed)
        if pushed.entry is None:
            retry = self._scheduler_retry_after()
            return self._refuse(state, errors.queue_full(request.model, retry), "queue_full")
        state.entry = pushed.entry
        state.waiter = asyncio.get_running_loop().create_future()
        state.hold_started = pushed.entry.enqueued_at
        self._metrics.queue_depth.labels(tenant.priority_class, tenant.name).inc()
        self._release_pass()
        if state.waiter.done():  # placed at once: it only waited behind requests that now fit too
            return state.waiter.result()
        state.phase = Phase.HELD
        return answers.extend_timeout(self._max_wait_s[tenant.priority] + HOLD_TIMEOUT_MARGIN_S)

    def _request_pass(self) -> None:
        """Capacity may have changed: run one release pass soon (many notifications, one pass)."""
        if self._pass_pending or not len(self.queue):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._pass_pending = True
        loop.call_soon(self._release_pass)

    def _release_pass(self) -> None:
        """Re-pick queued requests in the queue's order against the live snapshot; a domain whose first
        candidate does not fit is skipped for the rest of the pass."""
        self._pass_pending = False
        self._last_pass = self._timer()
        blocked: set[Hashable] = set()
        queue = self.queue
        while (entry := queue.next_candidate(blocked)) is not None:
            state: RequestState = entry.payload
            try:
                answer = self._place(state, may_hold=True)
            except Exception:
                log.exception("extproc failed while releasing a request (answered 500)")
                self._metrics.internal_errors.inc()
                answer = self._reject(state, errors.internal_error())
            if answer is None:
                blocked.add(entry.domain)
                continue
            if state.decision is not None:
                queue.take(entry)
                self._left_queue(state, "placed")
            else:
                self._dequeue(state, "refused")
            if state.waiter is not None and not state.waiter.done():
                state.waiter.set_result(answer)

    def _shed(self, entry: QueueEntry) -> None:
        """Pushed out of a full queue by a request of a higher class: 429 now."""
        state: RequestState = entry.payload
        self._left_queue(state, "shed")
        assert state.request is not None
        answer = self._refuse(state, errors.queue_full(state.request.model, self._scheduler_retry_after()),
                              "queue_full")
        if state.waiter is not None and not state.waiter.done():
            state.waiter.set_result(answer)

    def _dequeue(self, state: RequestState, outcome: str) -> None:
        if state.entry is not None and self.queue.remove(state.entry):
            self._left_queue(state, outcome)
        state.entry = None

    def _left_queue(self, state: RequestState, outcome: str) -> None:
        entry, tenant = state.entry, state.tenant
        state.entry = None
        if entry is None or tenant is None:
            return
        self._metrics.queue_depth.labels(tenant.priority_class, tenant.name).dec()
        self._metrics.queue_wait_seconds.labels(tenant.priority_class, outcome).observe(
            self._timer() - entry.enqueued_at)

    def _scheduler_retry_after(self) -> int:
        return max(1, round(min(self._max_wait_s, default=1.0)))

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
        context = self.pick_context()
        if state.subset is not None:
            fleet = context.snapshot
            context = replace(context, snapshot=within(fleet, state.subset))
            if not context.snapshot.workers_for(request.model) and request.model in fleet.models:
                return self._reject(state, errors.no_worker(request.model))  # the gateway left no endpoint
        outcome = self._scheduler.pick(request, context)
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
        if state.genai is not None:
            state.genai.model_known = True  # placed: a worker serves it
            state.genai.response_model = request.adapter or request.model
        extra: list[tuple[str, str]] = []
        if self._debug_header:
            extra.append((DECISION_HEADER, describe(decision, request)))
        tenant = state.tenant
        if tenant is not None and self.tenants.by_name:
            extra.append((TENANT_HEADER, tenant.name))
        log.debug("routed to %s (%s)", worker_id, decision.endpoint)
        return answers.routed_body(decision, request.facts.client_routing_headers, extra, state.new_body,
                                   header_pin=self._header_pin)

    def _release_quota(self, state: RequestState) -> None:
        """Give the quota back off the request path (one script call in a background task)."""
        ticket = state.ticket
        state.ticket = None
        assert ticket is not None and self._quotas is not None
        used = state.usage.total_tokens if state.usage is not None else None
        if state.decision is None and ticket.reserved_tokens:
            used = 0  # refused while queued: it never ran
        if ticket.reserved_tokens and self._reconcile:
            self._metrics.usage_reconciled.labels("observed" if used is not None else "estimated").inc()
        self._spawn(self._quotas.release(ticket, used))

    def _release_orphan(self, call: asyncio.Future[QuotaTicket | ApiError]) -> None:
        """An admission that completed after its stream was cancelled: give its slot back."""
        if call.cancelled() or call.exception() is not None or self._quotas is None:
            return
        ticket = call.result()
        if isinstance(ticket, QuotaTicket):
            self._spawn(self._quotas.release(ticket, 0))

    def _spawn(self, work: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(self._quietly(work))
        except RuntimeError:  # no loop (a synchronous caller): nothing can be released from here
            work.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quietly(self, work: Any) -> None:
        try:
            await work
        except Exception as exc:  # Redis away: the slot ends with its lease, the window with its minute
            self._metrics.quota_errors.labels("release").inc()
            log.debug("quota release failed: %s", exc)

    def _refuse(self, state: RequestState, error: ApiError, reason: str) -> ProcessingResponse:
        """A refusal of the tenant's request (identity, rights, quota, queue), counted by reason."""
        self._count_rejection(state, reason)
        return self._reject(state, error)

    def _count_rejection(self, state: RequestState, reason: str) -> None:
        tenant = state.tenant.name if state.tenant is not None else "unknown"
        self._metrics.rejections.labels(tenant, reason).inc()

    def _reject(self, state: RequestState, error: ApiError) -> ProcessingResponse:
        state.phase = Phase.DONE
        self._metrics.requests.labels(error.code or error.type).inc()
        if state.genai is not None:
            state.genai.refused(error.code or error.type, self._timer())
            self._record_genai(state)
        return answers.error_answer(error)


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


def _with_pools(request: PickRequest, tenant: Tenant) -> PickRequest:
    return replace(request, only_pools=tenant.only_pools, excluded_pools=tenant.excluded_pools)


def _with_version_pool(request: PickRequest, pool: str) -> PickRequest:
    """A catalogue version bound to one pool: only that pool, and only if the tenant may use it."""
    allowed = request.only_pools
    only = frozenset({pool}) if allowed is None else frozenset({pool}) & allowed
    return replace(request, only_pools=frozenset() if pool in request.excluded_pools else only)


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
        return answers.continue_response_body()
    if kind == "response_trailers":
        return ProcessingResponse(response_trailers=TrailersResponse())
    raise RuntimeError(f"unexpected ext_proc message {kind!r}")
