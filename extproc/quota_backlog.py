"""Quota charges that admissions made while Redis was away could not write, kept until they can be written.

With ``tenancy.quota_fail_open`` a request is admitted when Redis cannot be asked; before, its charge was
simply lost (a 30-minute chaos soak counted 2.4 % fewer tokens than its answers reported). Now the charge
is kept here, summed per tenant and second (the quota's bucket), and written once Redis answers again:

- **Bounded by the window.** An entry counts requests and tokens of one tenant in one second, so a tenant
  holds at most one entry per second of the last ``KEEP_MINUTES`` calendar minutes (the current one and
  the two before), twice over: the batch being sent and what came since (at most 360 entries of three
  integers; only tenants with limits are charged). That
  is how long the counters the charge belongs to live: a bucket counts for admissions for 61 s, a minute's
  accounting counter expires 3 minutes after its last write. A charge older than that is dropped when the
  next batch is made (``expired``: counted in ``poolgate_extproc_quota_deferred_charges``), because
  nothing reads it any more. When it is written, the bucket is charged only while it is still in the
  admission window, the minute counter always.
- **Written once.** Each batch (one tenant's entries) gets an id and is sent as one script that first sets
  the marker ``…:charged:{id}`` (``SET NX``, kept 5 minutes, longer than a batch is retried): a batch whose
  reply was lost is sent again with the same id and the same content, and applied at most once. The
  bounds that remain: an admission whose own reply was lost at the moment Redis went away (executed,
  then seen as a failure and admitted fail-open) is counted twice, at most one per admission in flight
  then; the charges of a process killed before Redis came back are lost (held in its memory only); a
  write the master acknowledged but had not replicated when it died is lost (asynchronous replication).
- Corrections at the request's end (reported usage against the reservation) of a request admitted so go
  here too, as a token delta on the same second, whether its charge was written meanwhile or not: the
  sums come out as if it had been admitted normally. Such a request held no concurrency slot and gets
  none afterwards.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

KEEP_MINUTES = 3
"""Calendar minutes whose charges are kept: the current one and the two before (see the module)."""
MARKER_TTL_MS = 5 * 60 * 1000
"""A batch's "written" marker outlives every retry of it (a batch is dropped after ``KEEP_MINUTES``)."""


@dataclass(frozen=True, slots=True)
class Charge:
    second: int
    requests: int
    tokens: int


@dataclass(frozen=True, slots=True)
class ChargeBatch:
    """One tenant's charges, written in one script call; ``id`` names it in the written-once marker."""

    tenant: str
    id: str
    charges: tuple[Charge, ...]
    requests: int
    """Admissions in it (their requests, for the metric)."""

    @property
    def newest_second(self) -> int:
        return max(c.second for c in self.charges)


class UnwrittenCharges:
    """Charges waiting for Redis. ``add`` on the request path (memory only); ``batches`` and ``written``
    for the writer, which sends every batch ``batches`` returns until each is ``written``."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._open: dict[str, dict[int, list[int]]] = {}
        """Tenant → second → [admissions, requests, tokens] not in a batch yet."""
        self._sealed: list[ChargeBatch] = []
        self._ids = itertools.count()
        self._process = os.urandom(6).hex()
        self.expired = 0
        """Admissions whose charge was dropped unwritten (too old to matter)."""

    def __bool__(self) -> bool:
        return bool(self._open or self._sealed)

    def add(self, tenant: str, second: int, *, requests: int = 0, tokens: int = 0, admission: bool = False) -> None:
        """Keep a charge (``admission``: one fail-open admission) or a correction (a token delta)."""
        entry = self._open.setdefault(tenant, {}).setdefault(second, [0, 0, 0])
        entry[0] += admission
        entry[1] += requests
        entry[2] += tokens

    def batches(self) -> list[ChargeBatch]:
        """What to write now: earlier batches not yet written (same ids, same content), and a new batch of
        what was added since for each tenant that has none waiting (so an outage leaves at most one batch
        and one open entry per tenant and second). Batches too old to matter are dropped (``expired``)."""
        oldest_minute = int(self._clock() // 60) - (KEEP_MINUTES - 1)
        kept = []
        for batch in self._sealed:
            if batch.newest_second // 60 < oldest_minute:
                self.expired += batch.requests
            else:
                kept.append(batch)
        self._sealed = kept
        waiting = {b.tenant for b in kept}
        for tenant in [t for t in self._open if t not in waiting]:
            seconds = self._open.pop(tenant)
            charges, admissions = [], 0
            for second, (admitted, requests, tokens) in sorted(seconds.items()):
                if second // 60 < oldest_minute:
                    self.expired += admitted
                elif requests or tokens:
                    charges.append(Charge(second, requests, tokens))
                    admissions += admitted
            if charges:
                self._sealed.append(ChargeBatch(tenant, f"{self._process}:{next(self._ids)}", tuple(charges),
                                                admissions))
        return list(self._sealed)

    def written(self, batch: ChargeBatch) -> None:
        self._sealed = [b for b in self._sealed if b.id != batch.id]
