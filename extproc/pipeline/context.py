"""One request as the director knows it: small frozen facts, one per stage that established them.

``Arrival`` (identify: headers, tenant, catalogue in force), ``Resolved`` (resolve: what is asked and what it
is expected to cost), ``Placement`` (place: where it went and what it reserved there). ``RequestContext``
gathers them with the two things a request holds while it lives (its quota slot and its queue place) and its
response feed; ``finish`` in the director gives everything back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from extproc.catalogue import Catalogue, Route
from extproc.flow_queue import QueueEntry
from extproc.pipeline.outcomes import Final
from extproc.pipeline.respond import ResponseFeed
from extproc.quota import QuotaTicket
from extproc.request import RequestFacts, RequestHead
from extproc.reservations import Reservation
from extproc.scheduling import Decision, PickRequest
from extproc.tenancy import Tenant


@dataclass(frozen=True, slots=True)
class Arrival:
    """What the headers said, and who asks."""

    head: RequestHead
    tenant: Tenant | None
    """None only on paths that need no identity (outside ``/v1/``)."""
    catalogue: Catalogue
    """The catalogue current when the request arrived; a reload does not change a request in flight."""
    subset: frozenset[str] | None = None
    """``ip:port`` endpoints the gateway allows for this request (endpoint-picker subset hint); None = all."""
    watch_usage: bool = False
    """The response body comes to extproc (asked at the headers phase) so its usage can be read."""


@dataclass(frozen=True, slots=True)
class Resolved:
    """The inference request after the catalogue and its parameters, profiled for the scheduler."""

    facts: RequestFacts
    request: PickRequest
    body: bytes | None = None
    """The request body as sent upstream, when extproc rewrote it (catalogue version, usage requested)."""
    renamed: Route | None = None
    """The version whose served name the response must lose again (its public name differs)."""


@dataclass(frozen=True, slots=True)
class Placement:
    decision: Decision
    reservation: Reservation
    """KV and prefill this request reserves on its worker until its stream ends (its in-flight count too)."""
    prefill: Reservation | None = None
    """A split request's reservation (and in-flight count) on its prefill worker; None when not split."""


@dataclass(frozen=True, slots=True)
class Queued:
    """Its place in the priority queue while it waits there."""

    entry: QueueEntry
    waiter: asyncio.Future[Final]
    """Resolved with the final outcome by a release pass (placed) or by shedding."""
    cold_start: bool = False
    """It waits for a pool scaled to zero to start a worker (``cold_start``), not for capacity."""


class RequestContext:
    """The director's record of one request; ``None`` fields are stages not reached (or given back)."""

    __slots__ = ("arrival", "placement", "prompt", "queued", "resolved", "response", "ticket")

    def __init__(self) -> None:
        self.arrival: Arrival | None = None
        self.resolved: Resolved | None = None
        self.placement: Placement | None = None
        self.ticket: QuotaTicket | None = None
        """The tenant's quota this request holds until its stream ends."""
        self.queued: Queued | None = None
        self.prompt: bytes | None = None
        """The body, kept from the body phase to the asynchronous step that tokenises it for cache lookups."""
        self.response = ResponseFeed()

    @property
    def tenant(self) -> Tenant | None:
        return self.arrival.tenant if self.arrival is not None else None

    @property
    def request(self) -> PickRequest | None:
        return self.resolved.request if self.resolved is not None else None

    @property
    def decision(self) -> Decision | None:
        return self.placement.decision if self.placement is not None else None
