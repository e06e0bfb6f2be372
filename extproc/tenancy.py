"""Who is asking: the tenant of a request, from its API key or a header set by a trusted ingress.

Keys are compared by SHA-256 digest only; the configuration never holds a key. Identification is a pure
function of the configuration and two header values, done once at the headers phase so a request without a
valid key is refused (401) before its body is read. With no tenants configured every request belongs to one
open default tenant, which keeps the gateway open as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc import errors
from extproc.errors import ApiError
from poolgate.kernel.config import TenancySettings, TenantSpec

DEFAULT_CLASS = "standard"


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant as the request path needs it: limits, class and pool rights, resolved once at start."""

    name: str
    priority: int
    """Index of its priority class (0 = highest)."""
    priority_class: str
    weight: float = 1.0
    models: frozenset[str] | None = None
    """Models it may use; None = every model."""
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    only_pools: frozenset[str] | None = None
    """Pools it is restricted to (its dedicated pools); None = any pool not dedicated to another tenant."""
    excluded_pools: frozenset[str] = frozenset()
    """Pools dedicated to other tenants."""

    @property
    def has_quota(self) -> bool:
        return (self.max_concurrent is not None or self.requests_per_minute is not None
                or self.tokens_per_minute is not None)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def bearer_token(authorization: str) -> str:
    """The key of ``Authorization: Bearer <key>``; empty when the header has another form."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class TenantDirectory:
    """Configured tenants by key digest and by name, plus the implicit default tenant."""

    def __init__(self, settings: TenancySettings, specs: Sequence[TenantSpec]) -> None:
        self.settings = settings
        self.classes = tuple(c.name for c in settings.priority_classes)
        owners = {pool: spec.name for spec in specs for pool in spec.dedicated_pools}
        self.by_name: Mapping[str, Tenant] = {spec.name: self._resolve(spec, owners) for spec in specs}
        self._by_digest = {digest: self.by_name[spec.name] for spec in specs for digest in spec.api_key_sha256}
        default_class = DEFAULT_CLASS if DEFAULT_CLASS in self.classes else self.classes[-1]
        self.default = self.by_name.get(settings.default_tenant) or Tenant(
            name=settings.default_tenant, priority=self.classes.index(default_class), priority_class=default_class,
            excluded_pools=frozenset(owners))
        self.header = settings.tenant_header if settings.trust_tenant_header else None
        """The header to read the tenant from; None when no ingress is trusted."""
        self.has_dedicated_pools = bool(owners)

    def _resolve(self, spec: TenantSpec, owners: Mapping[str, str]) -> Tenant:
        own = frozenset(spec.dedicated_pools)
        return Tenant(
            name=spec.name, priority=self.classes.index(spec.priority), priority_class=spec.priority,
            weight=spec.weight, models=frozenset(spec.models) if spec.models else None,
            max_concurrent=spec.max_concurrent, requests_per_minute=spec.requests_per_minute,
            tokens_per_minute=spec.tokens_per_minute,
            only_pools=own if own and spec.dedicated_only else None,
            excluded_pools=frozenset(pool for pool, owner in owners.items() if owner != spec.name),
        )

    def identify(self, authorization: str, claimed: str) -> Tenant | ApiError:
        """The request's tenant from its ``Authorization`` value and the trusted header's value (empty when
        absent or untrusted): trusted header, else a known key, else the default tenant unless keys are
        required. A key that matches no tenant is ignored when keys are not required (clients of an open
        gateway send placeholder keys)."""
        if claimed:
            tenant = self.by_name.get(claimed)
            return tenant if tenant is not None else errors.unknown_tenant()
        key = bearer_token(authorization) if authorization else ""
        if key and self._by_digest:
            tenant = self._by_digest.get(key_digest(key))
            if tenant is not None:
                return tenant
        if self.settings.require_api_key:
            return errors.invalid_api_key(bool(key))
        return self.default
