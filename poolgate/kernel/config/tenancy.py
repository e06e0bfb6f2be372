"""Tenants (API keys, limits, priority classes) and the ``tenancy`` section (extproc)."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from poolgate.kernel.config.base import Section
from poolgate.kernel.config.scheduling import MAX_WAIT_LIMIT_S
from poolgate.kernel.routing import ROUTING_HEADERS

PRIORITY_CLASS_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"


class PriorityClass(Section):
    """One class of the priority queue; classes are served in strict order (the first listed goes first)."""

    name: str = Field(pattern=PRIORITY_CLASS_PATTERN)
    max_wait_s: float | None = Field(None, ge=0, le=MAX_WAIT_LIMIT_S)
    """Longest a request of this class waits for capacity before 429 (default: ``scheduling.max_wait_s``)."""


class TenantSpec(Section):
    """One tenant: who it is (API key hashes), what it may use, and its limits (absent = unlimited)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    api_key_sha256: tuple[str, ...] = ()
    """Hex SHA-256 of each API key (``poolgate tenant add`` prints a new key and this hash); keys are never stored."""
    models: tuple[str, ...] = ()
    """Models the tenant may ask for (empty = every model); any other answers 403."""
    priority: str = Field("standard", pattern=PRIORITY_CLASS_PATTERN)
    """Name of a ``tenancy.priority_classes`` entry."""
    weight: float = Field(1.0, gt=0, le=1000)
    """Share of its class's capacity (by tokens) against other backlogged tenants of the class."""
    max_concurrent: int | None = Field(None, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    """Prompt estimate plus expected output, reserved at admission and reconciled with the real usage."""
    dedicated_pools: tuple[str, ...] = ()
    """Pools only this tenant may use; the tenant then runs only there unless ``dedicated_only`` is false."""
    dedicated_only: bool = True

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, hashes: tuple[str, ...]) -> tuple[str, ...]:
        bad = [h for h in hashes if len(h) != 64 or any(c not in "0123456789abcdef" for c in h)]
        if bad:
            raise ValueError("each entry must be 64 lower-case hex characters (a SHA-256 digest); "
                             "`poolgate tenant add NAME` prints one")
        return hashes

    @property
    def has_quota(self) -> bool:
        return any(v is not None for v in (self.max_concurrent, self.requests_per_minute, self.tokens_per_minute))


class TenancySettings(Section):
    """Identity, admission and the priority queue (extproc). With no tenants configured every request
    belongs to the implicit ``default_tenant`` (open access, no quotas)."""

    require_api_key: bool = False
    """Requests must carry ``Authorization: Bearer <key>`` of a configured tenant (else 401)."""
    tenant_header: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$")
    """Header naming the tenant, set by an ingress in front of Envoy. Read only when ``trust_tenant_header``;
    otherwise a client-sent copy is stripped and ignored. Must not be a poolgate routing header (Envoy
    strips those before anything reads them)."""
    trust_tenant_header: bool = False
    default_tenant: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    """Tenant of requests without a key when keys are not required (a configured tenant or an open one)."""
    priority_classes: tuple[PriorityClass, ...] = (
        PriorityClass(name="high"), PriorityClass(name="standard"), PriorityClass(name="low"))
    """Highest first."""
    max_queued: int = Field(1000, ge=0)
    """Requests held for capacity at once (per extproc process); on overflow the lowest class is shed."""
    quota_fail_open: bool = True
    """Admit when Redis cannot be asked (degraded: shows in ``poolgate_extproc_quota_errors``; the charge is kept
    and written once Redis answers), else 503."""
    reconcile_usage: bool = True
    """Watch response bodies of tenants with a tokens-per-minute limit to charge their real usage (costs
    extproc CPU per response chunk); streaming requests get ``stream_options.include_usage`` injected and
    the extra chunk hidden from clients that did not ask for it."""
    lease_s: float = Field(900.0, gt=0)
    """A concurrency slot not released by then (its extproc died) stops counting."""

    @model_validator(mode="after")
    def _classes(self) -> TenancySettings:
        names = [c.name for c in self.priority_classes]
        if not names:
            raise ValueError("priority_classes: at least one class is needed")
        if len(set(names)) != len(names):
            raise ValueError("priority_classes: names must be unique")
        if self.trust_tenant_header and not self.tenant_header:
            raise ValueError("trust_tenant_header needs tenant_header (the header the ingress sets)")
        if self.tenant_header in ROUTING_HEADERS:
            raise ValueError(f"tenant_header: {self.tenant_header} is removed by Envoy before extproc sees it; "
                             "use another name, e.g. x-tenant-id")
        return self
