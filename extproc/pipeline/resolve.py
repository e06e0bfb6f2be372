"""The resolve stage: the inference body → what exactly is asked, by whom, at what expected cost.

Parse the body, check the tenant may use the model (403), resolve it through the catalogue (version, traffic
split, LoRA adapter), apply the version's parameter defaults and caps (400 above a cap), rewrite the body
for the served name, then profile it (token estimates, task class, affinity keys) and narrow it to the
pools the tenant and the version allow. Pure apart from the injected random source of traffic splits.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import orjson

from extproc.catalogue import Catalogue, ModelCard, Route
from extproc.catalogue_source import CatalogueSource
from extproc.errors import ApiError, model_not_allowed
from extproc.parameters import apply_parameters
from extproc.pipeline.context import Arrival, Resolved
from extproc.pipeline.outcomes import ModelList, Refused
from extproc.pipeline.respond import ResponseFeed
from extproc.request import RequestFacts, RequestHead, facts_from_data, load_body
from extproc.scheduling import PickRequest, RequestProfiler
from extproc.tenancy import Tenant

_Rewrite = tuple[RequestFacts, bytes | None, Route | None]
"""Facts as scheduled, the body to send (None: unchanged), the route whose name responses must restore."""


class Resolve:
    def __init__(self, catalogue: CatalogueSource, profiler: RequestProfiler, rng: random.Random) -> None:
        self.catalogue = catalogue
        self._profiler = profiler
        self._rng = rng
        """Draws catalogue traffic splits."""

    @property
    def current(self) -> Catalogue:
        return self.catalogue.current

    def model_list(self, tenant: Tenant | None, fleet_models: Collection[str], created: int) -> ModelList:
        cards: tuple[ModelCard, ...] = self.catalogue.current.cards(fleet_models)
        if tenant is not None and tenant.models is not None:
            cards = tuple(c for c in cards if c.id in tenant.models)
        return ModelList(cards, created)

    def resolve(self, arrival: Arrival, raw: bytes, feed: ResponseFeed,
                fleet_models: Collection[str]) -> Resolved | Refused:
        head, tenant = arrival.head, arrival.tenant
        assert tenant is not None  # inference paths are identified at the headers phase
        data = load_body(raw)
        if isinstance(data, ApiError):
            return Refused(data)
        facts = facts_from_data(head, data)
        if isinstance(facts, ApiError):
            return Refused(facts)
        feed.resolved(facts, facts.model in fleet_models)
        if not tenant.may_use(facts.model):
            return Refused(model_not_allowed(facts.model), "model_not_allowed")
        route = arrival.catalogue.resolve(facts.model, tenant.name, self._rng)
        if route is not None and route.adapter is None:
            feed.resolved(facts, True)  # a catalogue name (any ``base:adapter`` is known once placed)
        body: bytes | None = None
        renamed: Route | None = None
        if route is not None and route.touches_body:
            rewritten = _rewrite(head, data, facts, route)
            if isinstance(rewritten, ApiError):
                return Refused(rewritten)
            facts, body, renamed = rewritten
        return Resolved(facts, _narrowed(self._profiler.profile(facts), tenant, route), body, renamed)


def _rewrite(head: RequestHead, data: dict[str, Any], facts: RequestFacts, route: Route) -> _Rewrite | ApiError:
    """Rewrite the body for the chosen version: parameter defaults and caps, then the served name."""
    changed = apply_parameters(data, route)
    if isinstance(changed, ApiError):
        return changed
    if not (changed or route.renames or route.adapter):
        return facts, None, None
    data["model"] = route.body_model
    body = orjson.dumps(data)
    renamed = route if route.renames and route.adapter is None else None  # an adapter's responses name it
    if changed:  # a default may have set max_tokens: the estimates must see it
        reparsed = facts_from_data(head, data)
        if isinstance(reparsed, ApiError):
            return reparsed
        facts = reparsed
    return replace(facts, model=route.served_name), body, renamed


def _narrowed(request: PickRequest, tenant: Tenant, route: Route | None) -> PickRequest:
    """The pools the tenant may use (a version bound to one pool: only that one, if the tenant may), the
    adapter asked for and the tenant's class (the saturation gate keeps headroom for the highest)."""
    if tenant.only_pools is not None or tenant.excluded_pools:
        request = replace(request, only_pools=tenant.only_pools, excluded_pools=tenant.excluded_pools)
    if route is not None and route.pool is not None:
        allowed = request.only_pools
        only = frozenset({route.pool}) if allowed is None else frozenset({route.pool}) & allowed
        request = replace(request, only_pools=frozenset() if route.pool in request.excluded_pools else only)
    if route is not None and route.adapter is not None:
        request = replace(request, adapter=route.adapter)
    if tenant.priority:
        request = replace(request, priority=tenant.priority)
    return request
