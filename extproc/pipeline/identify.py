"""The identify stage: the request's headers, its size limit and its tenant, before the body is read.

A missing or wrong API key is refused here (401) at the headers phase; the body never reaches extproc.
"""

from __future__ import annotations

from collections.abc import Iterable

from extproc.errors import ApiError, body_too_large
from extproc.pipeline.outcomes import Refused
from extproc.request import RequestHead, parse_head
from extproc.tenancy import Tenant, TenantDirectory


class Identify:
    def __init__(self, tenants: TenantDirectory, max_request_bytes: int) -> None:
        self.tenants = tenants
        self.max_request_bytes = max_request_bytes

    @property
    def names_tenants(self) -> bool:
        """Tenants are configured: the upstream request is told which one asked."""
        return bool(self.tenants.by_name)

    def head(self, headers: Iterable[tuple[str, str]]) -> RequestHead:
        settings = self.tenants.settings
        return parse_head(headers, settings.tenant_header, settings.trust_tenant_header)

    def oversized(self, size: int | None) -> Refused | None:
        """413 for a body (announced or received so far) above ``extproc.max_request_bytes``."""
        if size is not None and size > self.max_request_bytes:
            return Refused(body_too_large(size, self.max_request_bytes))
        return None

    def tenant(self, head: RequestHead) -> Tenant | Refused:
        identified = self.tenants.identify(head.authorization, head.tenant_claim)
        if isinstance(identified, ApiError):
            return Refused(identified, "invalid_api_key")
        return identified
