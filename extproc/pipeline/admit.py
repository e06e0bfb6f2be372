"""The admit stage: the tenant's quotas (concurrency, requests and tokens per minute), one Redis call each way.

Only tenants with limits are asked about (``quota``). When Redis cannot answer, ``tenancy.quota_fail_open``
decides: admit without a slot, or refuse with 503. The slot is given back at the stream's end off the request
path (a background task); for tenants charged by tokens the usage the response reported corrects the tokens
reserved at admission.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from extproc.errors import ApiError, quota_unavailable
from extproc.metrics import Metrics
from extproc.pipeline.outcomes import Refused
from extproc.quota import QuotaStore, QuotaTicket
from extproc.tenancy import Tenant
from poolgate.kernel.config import TenancySettings

log = logging.getLogger(__name__)

_REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


class Admit:
    def __init__(self, quotas: QuotaStore | None, settings: TenancySettings, metrics: Metrics) -> None:
        self._quotas = quotas
        self._fail_open = settings.quota_fail_open
        self._reconcile = quotas is not None and settings.reconcile_usage
        self._metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    def applies(self, tenant: Tenant) -> bool:
        return tenant.has_quota and self._quotas is not None

    def reconciles(self, tenant: Tenant) -> bool:
        """The tenant's token charge is corrected from the response's usage (its body must be read)."""
        return self._reconcile and tenant.tokens_per_minute is not None

    async def admit(self, tenant: Tenant, tokens: int) -> QuotaTicket | Refused | None:
        """The ticket to give back at the end, a refusal naming the limit, or None (admitted without a slot:
        Redis is away and quotas fail open). A stream cancelled meanwhile gives a late slot back."""
        assert self._quotas is not None
        call = asyncio.ensure_future(self._quotas.admit(tenant, tokens))
        try:
            outcome = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_orphan)
            raise
        except _REDIS_ERRORS as exc:
            self._metrics.quota_errors.labels("admit").inc()
            log.warning("quota admission failed for tenant %s (%s); %s", tenant.name, exc,
                        "admitting" if self._fail_open else "refusing")
            return None if self._fail_open else Refused(quota_unavailable(), "quota_unavailable")
        if isinstance(outcome, ApiError):
            return Refused(outcome, outcome.param or outcome.code or "quota")
        return outcome

    def release(self, ticket: QuotaTicket, used_tokens: int | None, ran: bool) -> None:
        """Give the slot back; ``used_tokens`` is the reported usage (None: keep the estimate), ``ran`` False
        for a request refused after admission (it used nothing)."""
        assert self._quotas is not None
        if not ran and ticket.reserved_tokens:
            used_tokens = 0
        if ticket.reserved_tokens and self._reconcile:
            self._metrics.usage_reconciled.labels("observed" if used_tokens is not None else "estimated").inc()
        self._spawn(self._quotas.release(ticket, used_tokens))

    def _release_orphan(self, call: asyncio.Future[QuotaTicket | ApiError]) -> None:
        """An admission that completed after its stream was cancelled: give its slot back."""
        if call.cancelled() or call.exception() is not None or self._quotas is None:
            return
        ticket = call.result()
        if isinstance(ticket, QuotaTicket):
            self._spawn(self._quotas.release(ticket, 0))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(self._quietly(work))
        except RuntimeError:  # no loop (a synchronous caller): nothing can be released from here
            work.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quietly(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as exc:  # Redis away: the slot ends with its lease, the window with its minute
            self._metrics.quota_errors.labels("release").inc()
            log.debug("quota release failed: %s", exc)
