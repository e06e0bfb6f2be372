"""The director: one request's way through the stages, as the servicer reports what Envoy sent.

    headers → identify (tenant, size) → model list | unknown /v1 path (404) | passthrough | body follows
    body    → resolve (catalogue, parameters, profile) → admit (quota) → place now, or hold (queue) → place
    response headers / body → respond (usage, model name, GenAI observers)
    stream end → finish: give back the queue place, in-flight count, reservation and quota slot

Stages answer outcomes (``outcomes``); the director counts how requests end (``poolgate_extproc_requests``,
``…_rejections``) and tells the response feed about refusals. It never sees a protobuf and never raises into
the servicer on the asynchronous steps (admission, holding): an unexpected exception there is a logged 500.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from extproc.disagg import PairDecision
from extproc.endpoints import path_fate
from extproc.errors import cold_start_timeout, internal_error, invalid_request, no_capacity, unknown_path
from extproc.metrics import Metrics
from extproc.output_lengths import OutputLengths
from extproc.pipeline.admit import Admit
from extproc.pipeline.cold_start import COLD_START_RETRY_AFTER_S, ColdStarts, settled
from extproc.pipeline.context import Arrival, RequestContext
from extproc.pipeline.hold import Hold
from extproc.pipeline.identify import Identify
from extproc.pipeline.outcomes import (
    ADMITTING,
    Admitting,
    Final,
    ModelList,
    Passthrough,
    Placed,
    Proceed,
    Refused,
    RewriteBody,
    Routing,
)
from extproc.pipeline.place import Place
from extproc.pipeline.resolve import Resolve
from extproc.pipeline.respond import Respond
from extproc.queue_order import QueueOrder
from extproc.scheduling import Decision, NoCapacity, PickRequest
from poolgate.kernel.routing import QUEUE_WAIT_HEADER

log = logging.getLogger(__name__)

INTERNAL_ERROR = Refused(internal_error())


class Director:
    def __init__(self, identify: Identify, resolve: Resolve, admit: Admit, hold: Hold, place: Place,
                 respond: Respond, metrics: Metrics, clock: Callable[[], float] = time.time,
                 timer: Callable[[], float] = time.perf_counter, lengths: OutputLengths | None = None,
                 cold_starts: ColdStarts | None = None, queue_order: QueueOrder | None = None) -> None:
        self.identify = identify
        self.resolve = resolve
        self.admit_stage = admit
        self.hold_stage = hold
        self.place = place
        self.respond = respond
        self._metrics = metrics
        self._clock = clock
        self._timer = timer
        """Monotonic timer for durations and queue deadlines."""
        self.lengths = lengths
        """Learned output lengths (expected output below ``max_tokens``); None = the cap or the default."""
        self.cold_starts = cold_starts or ColdStarts()
        """Pools that may scale to zero: a request finding them empty waits for a worker (``cold_start``)."""
        self.queue_order = queue_order
        """The best class other replicas hold waiting per pool: a pick leaves those pools to them (None: alone)."""

    def headers(self, context: RequestContext, headers: Iterable[tuple[str, str]], subset: frozenset[str] | None,
                end_of_stream: bool) -> Proceed | Passthrough | ModelList | Refused:
        head = self.identify.head(headers)
        self.respond.arrived(context.response, head, self._timer())
        oversized = self.identify.oversized(head.content_length)
        if oversized is not None:
            return self.refuse(context, oversized)
        tenant = None
        if head.is_api or head.is_model_list:
            identified = self.identify.tenant(head)
            if isinstance(identified, Refused):
                return self.refuse(context, identified)
            tenant = identified
        catalogue = self.resolve.current
        if path_fate(head.method, head.path) == "unknown":  # never to a random worker
            context.arrival = Arrival(head, tenant, catalogue, subset)
            return self.refuse(context, Refused(unknown_path(head.method, head.path)))
        if head.is_model_list:
            context.arrival = Arrival(head, tenant, catalogue, subset)
            self._metrics.requests.labels("model_list").inc()
            return self.resolve.model_list(tenant, self.place.snapshot.models, int(self._clock()))
        if not end_of_stream:
            observed = bool(context.response.observers)
            watch = observed or (head.is_inference and tenant is not None and self.admit_stage.reconciles(tenant))
            watch = watch or (head.is_inference and self.lengths is not None and self.lengths.wants_sample())
            context.arrival = Arrival(head, tenant, catalogue, subset, watch)
            return Proceed(watch, head.is_inference and (catalogue.renames or observed))
        context.arrival = Arrival(head, tenant, catalogue, subset)
        if head.is_inference:
            return self.refuse(context, Refused(invalid_request("The request body must be a JSON object.",
                                                                code="missing_body")))
        self._metrics.requests.labels("passthrough").inc()
        return Passthrough(head.client_routing_headers)

    def body_received(self, context: RequestContext, size: int) -> Refused | None:
        """A 413 as soon as the body received so far is too large."""
        oversized = self.identify.oversized(size)
        return None if oversized is None else self.refuse(context, oversized)

    def body(self, context: RequestContext, raw: bytes) -> Passthrough | Admitting | Routing:
        """The whole body arrived: resolve the request, then admit (``ADMITTING``: ask ``admit``) or route it."""
        arrival = context.arrival
        assert arrival is not None
        if not arrival.head.is_inference:
            self._metrics.requests.labels("passthrough").inc()
            return Passthrough(arrival.head.client_routing_headers)
        resolved = self.resolve.resolve(arrival, raw, context.response, self.place.snapshot.models)
        if isinstance(resolved, Refused):
            return self.refuse(context, resolved)
        if arrival.watch_usage:
            resolved = replace(resolved, body=self.respond.watch_usage(context.response, resolved.facts,
                                                                       resolved.body, raw))
        assert arrival.tenant is not None
        if self.lengths is not None:
            resolved = replace(resolved, request=self.lengths.refine(resolved.request, arrival.tenant.name))
        context.resolved = resolved
        if self.place.wants_prompt(resolved.request):
            context.prompt = resolved.body or raw  # tokenised on the asynchronous step (maybe in a thread)
            return ADMITTING
        if self.admit_stage.applies(arrival.tenant):
            return ADMITTING
        return self._route(context)

    async def admit(self, context: RequestContext) -> Routing:
        """Tokenise the prompt for cache lookups where asked, ask the tenant's quotas, then route. Never raises
        (apart from the stream's cancellation)."""
        tenant, request, resolved = context.tenant, context.request, context.resolved
        assert tenant is not None and request is not None and resolved is not None
        if context.prompt is not None:
            body, context.prompt = context.prompt, None
            try:
                context.resolved = replace(resolved, request=await self.place.prepare(request, body))
            except Exception:
                log.exception("preparing the cache lookup failed; the scheduler estimates for this request")
            request = context.request
            assert request is not None
        if not self.admit_stage.applies(tenant):
            return self._routed_or_failed(context)
        try:
            admitted = await self.admit_stage.admit(tenant, request.total_tokens)
        except Exception:
            log.exception("quota admission failed (answered 500)")
            return self.failed(context)
        if isinstance(admitted, Refused):
            return self.refuse(context, admitted)
        context.ticket = admitted
        return self._routed_or_failed(context)

    def _routed_or_failed(self, context: RequestContext) -> Routing:
        try:
            return self._route(context)
        except Exception:
            log.exception("extproc failed on a request (answered 500)")
            return self.failed(context)

    async def hold(self, context: RequestContext) -> Final:
        """Wait in the queue until a release pass places the request, it is shed, or its class's deadline
        passes (then one last pick, else 429). Never raises (a cancelled stream cancels it, which is fine:
        ``finish`` takes the request out of the queue)."""
        assert context.queued is not None
        started = context.queued.entry.enqueued_at
        cold_start = context.queued.cold_start
        outcome = "cancelled"  # the client went away (Envoy reset the stream) while held
        self._metrics.held_requests.inc()
        try:
            final = await self.hold_stage.wait(self, context)
            if final is None:
                final = self._place(context, may_hold=False, held_since=started)
                assert final is not None  # may not hold: placed or refused
                if context.decision is None:
                    timed_out = isinstance(final, Refused) and final.error.code == "cold_start_timeout"
                    self.count_rejection(context, "cold_start_timeout" if timed_out else "queue_deadline")
            outcome = "placed" if context.decision is not None else "refused"
            return final
        except Exception:
            log.exception("extproc failed while holding a request (answered 500)")
            outcome = "refused"
            return self.failed(context)
        finally:
            self._metrics.held_requests.dec()
            self._metrics.hold_seconds.labels(outcome).observe(self._timer() - started)
            if cold_start:
                self._cold_start_ended(context, outcome, self._timer() - started)

    def response_headers(self, context: RequestContext, status: int | None, end_of_stream: bool) -> RewriteBody | None:
        """Asked while the GenAI metrics are on (the status tells a worker's error) or the catalogue renames
        models (the body of a request sent under another name must be rewritten: ``RewriteBody``)."""
        context.response.headers(status, end_of_stream, self._timer())
        resolved, arrival = context.resolved, context.arrival
        if resolved is None or resolved.renamed is None or context.placement is None or arrival is None:
            return None
        self.respond.rename(context.response, resolved.renamed)
        return RewriteBody(body_watched=arrival.watch_usage)

    def response_body(self, context: RequestContext, chunk: bytes, end_of_stream: bool) -> bytes | None:
        return context.response.chunk(chunk, end_of_stream, self._timer())

    def finish(self, context: RequestContext) -> None:
        """The stream ended (Envoy closes it when the HTTP request is done): release what it holds."""
        if context.queued is not None:
            self.hold_stage.leave(context, "cancelled")
        placement = context.placement
        if placement is not None:
            self.place.release(placement)
            context.placement = None
            self._learn_length(context)
        if context.ticket is not None:
            usage = context.response.usage
            self.admit_stage.release(context.ticket, usage.total_tokens if usage is not None else None,
                                     ran=placement is not None)
            context.ticket = None
        context.response.close(self._timer())  # still waiting: the stream closed before the response's end
        if placement is not None:
            self.hold_stage.capacity_changed.notify()

    def _learn_length(self, context: RequestContext) -> None:
        usage, request, tenant = context.response.usage, context.request, context.tenant
        if self.lengths is None or usage is None or usage.output_tokens is None or request is None or tenant is None:
            return
        self.lengths.observe(request.model, request.task_class, tenant.name, usage.output_tokens)

    def place_held(self, context: RequestContext) -> Final | None:
        held_since = context.queued.entry.enqueued_at if context.queued is not None else None
        try:
            return self._place(context, may_hold=True, held_since=held_since)
        except Exception:
            log.exception("extproc failed while releasing a request (answered 500)")
            return self.failed(context)

    def refuse(self, context: RequestContext, refused: Refused) -> Refused:
        """The request ends in an error answer: counted by code (and by tenant and reason when it has one)."""
        if refused.reason is not None:
            self.count_rejection(context, refused.reason)
        code = refused.error.code or refused.error.type
        self._metrics.requests.labels(code).inc()
        context.response.refused(code, self._timer())
        return refused

    def count_rejection(self, context: RequestContext, reason: str) -> None:
        tenant = context.tenant
        self._metrics.rejections.labels(tenant.name if tenant is not None else "unknown", reason).inc()

    def failed(self, context: RequestContext) -> Refused:
        """An unexpected exception on the request path: a 500 answer and a metric."""
        self._metrics.internal_errors.inc()
        return self.refuse(context, INTERNAL_ERROR)

    def _route(self, context: RequestContext) -> Routing:
        """Place an admitted request now, or queue it (behind others waiting for the same capacity)."""
        tenant, request = context.tenant, context.request
        assert tenant is not None and request is not None
        self._metrics.admissions.labels(tenant.name, tenant.priority_class).inc()
        domain = (request.model, tenant.only_pools, tenant.excluded_pools)
        may_hold = self.hold_stage.may_hold(tenant.priority)
        if not (may_hold and self.hold_stage.queue.has_waiting(domain)):
            final = self._place(context, may_hold=may_hold)
            if final is not None:
                return final
        return self.hold_stage.enqueue(self, context, domain, self.place.predicted_prefill_s(request),
                                       self._cold_start_s(request))

    def _cold_start_s(self, request: PickRequest) -> float | None:
        """The cold-start wait when every pool the request may use is empty and one may scale from zero."""
        return self.cold_starts.wait_s(request, self.place.snapshot) if self.cold_starts else None

    def _cold_start_ended(self, context: RequestContext, outcome: str, waited_s: float) -> None:
        request, decision = context.request, context.decision
        assert request is not None
        self._metrics.cold_start_seconds.labels(request.model, outcome).observe(waited_s)
        where = f" on {decision.worker_id}" if decision is not None else ""
        log.info("cold start: a request for %r waited %.1f s for a worker and was %s%s", request.model, waited_s,
                 outcome, where)

    def _place(self, context: RequestContext, may_hold: bool, held_since: float | None = None) -> Final | None:
        """Pick and conclude; None when there is no capacity now and the request may be held, or when it waits
        for a pool scaled to zero to start a worker (a held request's last pick, ``may_hold`` False with
        ``held_since``, says it waited its limit)."""
        request, arrival, tenant = context.request, context.arrival, context.tenant
        assert request is not None and arrival is not None and tenant is not None
        if held_since is not None:
            request = replace(request, held_s=self._timer() - held_since)
        if may_hold and self.queue_order is not None and not self._deadline_near(context):
            narrowed = self.queue_order.narrowed(request, tenant.priority)
            if narrowed is None:
                return None  # a higher class waits in another replica for every pool it may use
            request = narrowed
        outcome = self.place.pick(request, arrival.subset)
        if isinstance(outcome, Decision | PairDecision):
            queued = context.queued
            if queued is not None and queued.cold_start and isinstance(outcome, Decision) and not settled(
                    self.place.snapshot.by_id.get(outcome.worker_id), self._clock()):
                return None  # Envoy may not have the new endpoint yet; the hold's poll tries again soon
            since = held_since if held_since is not None else queued.entry.enqueued_at if queued else None
            return self._commit(context, outcome, since)
        if isinstance(outcome, Refused) and outcome.error.code == "no_ready_worker" and self._cold_start_s(request):
            if may_hold or held_since is None:  # still waiting, or not yet queued
                return None
            waited = self._timer() - held_since
            return self.refuse(context, Refused(cold_start_timeout(request.model, waited, COLD_START_RETRY_AFTER_S)))
        if isinstance(outcome, NoCapacity):
            if may_hold:
                return None
            self.place.count_no_capacity(request, outcome)
            waited = 0.0 if held_since is None else self._timer() - held_since
            return self.refuse(context, Refused(no_capacity(request.model, waited, outcome.retry_after_s)))
        return self.refuse(context, outcome)

    def _deadline_near(self, context: RequestContext) -> bool:
        """A held request near its deadline goes even while a higher class waits elsewhere."""
        queued = context.queued
        return queued is not None and self.hold_stage.queue.is_urgent(queued.entry)

    def _commit(self, context: RequestContext, decision: Decision | PairDecision, held_since: float | None) -> Placed:
        resolved, tenant = context.resolved, context.tenant
        assert resolved is not None
        request = resolved.request
        placement = context.placement = self.place.commit(request, decision)
        self._metrics.requests.labels("routed").inc()
        context.response.placed(request)
        named = tenant if self.identify.names_tenants else None
        log.debug("routed to %s (%s)", placement.decision.worker_id, placement.decision.endpoint)
        headers = self.place.headers(decision, request, named)
        if held_since is not None:
            headers += ((QUEUE_WAIT_HEADER, str(round((self._timer() - held_since) * 1000))),)
        return Placed(placement.decision, request.facts.client_routing_headers, headers, resolved.body)
