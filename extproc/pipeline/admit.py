"""The admit stage: the tenant's quotas (concurrency, requests and tokens per minute), one Redis call each way.

Only tenants with limits are asked about (``quota``). When Redis cannot answer, ``tenancy.quota_fail_open``
decides: admit without a slot, or refuse with 503. A request admitted so is still charged: its charge is kept
(``extproc.quota_backlog``) and written by one background task, retried every ``RETRY_S``, once Redis answers.
The slot is given back at the stream's end off the request path (a background task); for tenants charged by
tokens the usage the response reported corrects the tokens reserved at admission.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from extproc.errors import ApiError, quota_unavailable
from extproc.metrics import Metrics
from extproc.pipeline.outcomes import Refused
from extproc.quota import QuotaStore, QuotaTicket
from extproc.quota_backlog import UnwrittenCharges
from extproc.tenancy import Tenant
from poolgate.kernel.config import TenancySettings
from poolgate.kernel.outage import REDIS_ERRORS

log = logging.getLogger(__name__)

RETRY_S = 0.5
"""How often the kept charges are tried again while Redis stays away."""


class Admit:
    def __init__(self, quotas: QuotaStore | None, settings: TenancySettings, metrics: Metrics) -> None:
        self._quotas = quotas
        self._fail_open = settings.quota_fail_open
        self._reconcile = quotas is not None and settings.reconcile_usage
        self._metrics = metrics
        self._background: set[asyncio.Task[None]] = set()
        self._unwritten = UnwrittenCharges()
        self._writer: asyncio.Task[None] | None = None

    def applies(self, tenant: Tenant) -> bool:
        return tenant.has_quota and self._quotas is not None

    def reconciles(self, tenant: Tenant) -> bool:
        """The tenant's token charge is corrected from the response's usage (its body must be read)."""
        return self._reconcile and tenant.tokens_per_minute is not None

    async def admit(self, tenant: Tenant, tokens: int) -> QuotaTicket | Refused:
        """The ticket to give back at the end (an ``unwritten`` one when Redis is away and quotas fail open)
        or a refusal naming the limit. A stream cancelled meanwhile gives a late slot back."""
        assert self._quotas is not None
        call = asyncio.ensure_future(self._quotas.admit(tenant, tokens))
        try:
            outcome = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_orphan)
            raise
        except REDIS_ERRORS as exc:
            self._metrics.quota_errors.labels("admit").inc()
            log.warning("quota admission failed for tenant %s (%s); %s", tenant.name, exc,
                        "admitting, its charge kept until Redis answers" if self._fail_open else "refusing")
            return self._admit_unwritten(tenant, tokens) if self._fail_open else Refused(
                quota_unavailable(), "quota_unavailable")
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
        if ticket.unwritten:
            self._keep_correction(ticket, used_tokens)
            return
        self._spawn(self._release(ticket, used_tokens))

    async def _release(self, ticket: QuotaTicket, used_tokens: int | None) -> None:
        """Release in Redis; a correction Redis could not take is kept with the unwritten charges (the slot
        ends with its lease)."""
        assert self._quotas is not None
        try:
            await self._quotas.release(ticket, used_tokens)
        except REDIS_ERRORS as exc:
            self._metrics.quota_errors.labels("release").inc()
            log.debug("quota release failed: %s", exc)
            self._keep_correction(ticket, used_tokens)

    def _keep_correction(self, ticket: QuotaTicket, used_tokens: int | None) -> None:
        if delta := ticket.correction(used_tokens):
            self._unwritten.add(ticket.tenant, ticket.second, tokens=delta)
            self._write_unwritten_soon()

    def _admit_unwritten(self, tenant: Tenant, tokens: int) -> QuotaTicket:
        assert self._quotas is not None
        ticket = self._quotas.unwritten_ticket(tenant, tokens)
        requests = 1 if tenant.requests_per_minute else 0
        if requests or ticket.reserved_tokens:
            self._unwritten.add(tenant.name, ticket.second, requests=requests, tokens=ticket.reserved_tokens,
                               admission=True)
            self._metrics.quota_deferred_charges.labels("kept").inc()
            self._write_unwritten_soon()
        return ticket

    def _write_unwritten_soon(self) -> None:
        if self._writer is None or self._writer.done():
            try:
                self._writer = asyncio.get_running_loop().create_task(self._write_unwritten())
            except RuntimeError:  # no loop (a synchronous caller): the next admission starts the writer
                return

    async def _write_unwritten(self) -> None:
        """Until the backlog is empty: send every batch; one that fails is sent again (same id) after RETRY_S."""
        assert self._quotas is not None
        while self._unwritten:
            failed = False
            for batch in self._unwritten.batches():
                try:
                    await self._quotas.write_charges(batch)
                except REDIS_ERRORS as exc:
                    log.debug("writing kept quota charges failed: %s", exc)
                    failed = True
                    break
                self._unwritten.written(batch)
                self._metrics.quota_deferred_charges.labels("written").inc(batch.requests)
            if self._unwritten.expired:
                self._metrics.quota_deferred_charges.labels("expired").inc(self._unwritten.expired)
                log.warning("dropped the kept quota charges of %d admissions: Redis was away for minutes",
                            self._unwritten.expired)
                self._unwritten.expired = 0
            if failed:
                await asyncio.sleep(RETRY_S)
        log.info("kept quota charges: none left to write")

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
