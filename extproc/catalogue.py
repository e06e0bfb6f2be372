"""The model catalogue as the request path uses it: public name → the version a request is sent to.

Built once per configuration (an immutable value, swapped whole on reload) and asked per request through
``Catalogue.resolve``: a pure function of the asked name, the tenant and an injected random source, done
before scheduling. Rules (tenant → version) win over weights; weights split traffic by a cumulative table
and one uniform draw. The chosen version's served name is what the scheduler looks up, so it selects the
pools. A pool's ``model`` that no catalogue entry names stays an implicit single-version entry (it resolves
to None: the request goes on unchanged); a version's served name asked directly resolves to that version,
so its parameter caps hold either way.

LoRA adapters: ``base:adapter``, or a name listed in ``catalogue.adapters``, resolves like ``base`` (so the
scheduler looks up the base model's workers) with ``Route.adapter`` set; the body's model becomes the adapter
name, which is what vLLM serves it under. The ``base:adapter`` form is recognised only when ``base`` is a name
the catalogue knows (a model, alias, version's served name or a configured adapter's base): a pool model that
itself contains a colon must keep working unchanged.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from poolgate.kernel.config import CatalogueModel, CatalogueSettings, ModelVersion, ParameterValue

_NO_PARAMETERS: Mapping[str, ParameterValue] = MappingProxyType({})
_NO_CAPS: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Route:
    """Where one resolved request goes and what the version demands of it."""

    public_name: str
    """What the client asked for; restored in the response when it differs from ``served_name``."""
    served_name: str
    version: str
    pool: str | None = None
    defaults: Mapping[str, ParameterValue] = field(default_factory=lambda: _NO_PARAMETERS)
    maximums: Mapping[str, float] = field(default_factory=lambda: _NO_CAPS)
    max_model_len: int | None = None
    adapter: str | None = None
    """LoRA adapter the request asks for; the body is sent with this as its model, on ``served_name``'s workers."""

    @property
    def renames(self) -> bool:
        return self.public_name != self.served_name

    @property
    def body_model(self) -> str:
        """The model name the worker must see in the body."""
        return self.adapter or self.served_name

    @property
    def touches_body(self) -> bool:
        """The request body must be read as JSON and possibly rewritten for this route."""
        return (self.renames or bool(self.defaults) or bool(self.maximums) or self.max_model_len is not None
                or self.adapter is not None)


@dataclass(frozen=True, slots=True)
class _Entry:
    routes: tuple[Route, ...]
    cumulative: tuple[float, ...]
    """Running sum of the versions' weights, in ``routes`` order (empty: always the first version)."""
    by_tenant: Mapping[str, Route]

    def choose(self, tenant: str, rng: random.Random) -> Route:
        pinned = self.by_tenant.get(tenant)
        if pinned is not None:
            return pinned
        if len(self.routes) == 1 or not self.cumulative:
            return self.routes[0]
        draw = rng.random() * self.cumulative[-1]
        return self.routes[min(bisect.bisect_right(self.cumulative, draw), len(self.routes) - 1)]


def _route(public: str, version: ModelVersion) -> Route:
    return Route(public_name=public, served_name=version.served_name, version=version.name, pool=version.pool,
                 defaults=MappingProxyType(dict(version.defaults)), maximums=MappingProxyType(dict(version.maximums)),
                 max_model_len=version.max_model_len)


def _entry(public: str, model: CatalogueModel) -> _Entry:
    routes = tuple(_route(public, v) for v in model.versions)
    by_name = {r.version: r for r in routes}
    cumulative: list[float] = []
    if model.weights:
        total = 0.0
        for route in routes:
            total += model.weights.get(route.version, 0.0)
            cumulative.append(total)
    by_tenant: dict[str, Route] = {}
    for rule in model.rules:
        for tenant in rule.tenants:
            by_tenant.setdefault(tenant, by_name[rule.version])
    return _Entry(routes, tuple(cumulative), MappingProxyType(by_tenant))


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One ``/v1/models`` entry."""

    id: str
    max_model_len: int | None = None
    precision: str | None = None


class Catalogue:
    """Immutable: a new configuration builds a new one. ``generation`` counts reloads (for logs/metrics)."""

    __slots__ = ("_adapter_bases", "_adapters", "_cards", "_entries", "_hidden", "generation", "renames", "settings")

    def __init__(self, settings: CatalogueSettings, generation: int = 0) -> None:
        self.settings = settings
        entries: dict[str, _Entry] = {}
        cards: list[ModelCard] = []
        for model in settings.models:
            first = model.versions[0]
            for public in (model.name, *model.aliases):
                entries[public] = _entry(public, model)
                cards.append(ModelCard(public, first.max_model_len, first.precision))
        hidden: set[str] = set()
        for model in settings.models:
            for version in model.versions:
                if version.served_name not in entries:
                    entries[version.served_name] = _Entry((_route(version.served_name, version),), (),
                                                          MappingProxyType({}))
                    hidden.add(version.served_name)
                    if settings.list_served_names:
                        cards.append(ModelCard(version.served_name, version.max_model_len, version.precision))
        self._entries: Mapping[str, _Entry] = MappingProxyType(entries)
        self._cards = tuple(cards)
        self._hidden = frozenset(hidden)
        self._adapters: Mapping[str, str] = MappingProxyType({a.name: a.base for a in settings.adapters})
        """Configured adapter name → base model's served name."""
        self._adapter_bases = frozenset(self._adapters.values())
        self.generation = generation
        self.renames = any(r.renames for e in entries.values() for r in e.routes)
        """Some public name differs from its served name: responses may need the public name restored."""

    def resolve(self, model: str, tenant: str, rng: random.Random) -> Route | None:
        """The version a request for ``model`` by ``tenant`` goes to; None for names the catalogue does not
        hold (pool models outside it, unknown names: the scheduler decides)."""
        entry = self._entries.get(model)
        if entry is not None:
            return entry.choose(tenant, rng)
        base = self._adapters.get(model)
        adapter = model
        if base is None:
            base, colon, adapter = model.rpartition(":")
            if not (colon and base and adapter) or (base not in self._entries and base not in self._adapter_bases):
                return None
        route = self.resolve(base, tenant, rng)
        if route is None:
            return Route(public_name=model, served_name=base, version="", adapter=adapter)
        return replace(route, public_name=model, adapter=adapter)

    def cards(self, fleet_models: Iterable[str]) -> tuple[ModelCard, ...]:
        """What ``/v1/models`` lists: public names and aliases, then the fleet's other names, without the
        versions' internal served names (unless ``list_served_names``)."""
        listed = {card.id for card in self._cards}
        extra = tuple(ModelCard(name) for name in fleet_models if name not in listed and name not in self._hidden)
        return self._cards + extra


EMPTY_CATALOGUE = Catalogue(CatalogueSettings())
