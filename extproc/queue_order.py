"""Class order across extproc replicas: a request is not placed on a pool for which another replica holds a
higher priority class waiting.

Each replica's queue keeps strict class order on its own (``flow_queue``), but the replicas share the
workers, so without this a lower-class request is released in one replica while a class-0 request waits in
another for the same pool. So each replica publishes, per pool, the best class it holds waiting (``report``,
in the batched peer write: ``peers``) and each refresh reads the others' (``apply``; a report older than
``REPORT_TTL_S`` is ignored: its replica died or lost Redis; so are all of them when this replica could not
read them for that long). A pick then leaves out the pools where a higher class waits elsewhere
(``narrowed``); when that is every pool the request may use, the request waits (it is held, or stays held).
Exempt: a held request near its deadline (the queue's urgency rule) and a held request's last pick, at its
deadline.

How close this gets: a report reaches the others after the next flush (≤ 20 ms after the queue changed)
and their next refresh (``extproc.snapshot_refresh_s``), so a lower class can still go in that window; a
replica that holds a class-0 request still uses only its own share of a worker's free room
(``reservations``), which the others now leave free, so its share grows as the worker drains.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import replace

from extproc.scheduling import PickRequest
from poolgate.kernel.config import PoolSpec

REPORT_REFRESH_S = 0.5
"""A replica rewrites its report at least this often while it holds requests (and at once when it changes)."""
REPORT_TTL_S = 1.5
"""A report not rewritten for this long is ignored."""


def domain_pools(domain: Hashable, pools: Iterable[PoolSpec]) -> list[str]:
    """The pools a queue domain ``(model, only_pools, excluded_pools)`` may use (none for another shape): each
    of them could take its requests."""
    if not (isinstance(domain, tuple) and len(domain) == 3):
        return []
    model, only, excluded = domain
    return [pool.name for pool in pools
            if pool.model == model and (only is None or pool.name in only) and pool.name not in (excluded or ())]


class QueueOrder:
    """This replica's report of what it holds waiting, and the other replicas' best class per pool."""

    def __init__(self, pools: Sequence[PoolSpec], waiting: Callable[[], Mapping[Hashable, int]],
                 clock: Callable[[], float] = time.time) -> None:
        """``waiting``: the queue's best class per domain (``FlowQueue.best_waiting``)."""
        self._pools = tuple(pools)
        self._waiting = waiting
        self._clock = clock
        self._elsewhere: Mapping[str, int] = {}
        self._read_at = float("-inf")

    def report(self) -> dict[str, int]:
        """Pool → the best class this replica holds waiting for it (a request counts for every pool it may use)."""
        best: dict[str, int] = {}
        for domain, priority in self._waiting().items():
            for pool in domain_pools(domain, self._pools):
                if priority < best.get(pool, priority + 1):
                    best[pool] = priority
        return best

    def apply(self, elsewhere: Mapping[str, int]) -> None:
        """Pool → the best class the other replicas hold waiting (fresh reports only), read just now."""
        self._elsewhere, self._read_at = elsewhere, self._clock()

    def _current(self) -> Mapping[str, int]:
        if self._elsewhere and self._clock() - self._read_at > REPORT_TTL_S:
            self._elsewhere = {}  # not read for too long (Redis away): it says nothing any more
        return self._elsewhere

    def outranked(self, domain: Hashable, priority: int) -> tuple[list[str], frozenset[str]]:
        """The pools a queue domain may use, and those of them where a class higher than ``priority`` waits in
        another replica."""
        usable = domain_pools(domain, self._pools)
        elsewhere = self._current()
        if not elsewhere:
            return usable, frozenset()
        return usable, frozenset(pool for pool in usable if elsewhere.get(pool, priority) < priority)

    def narrowed(self, request: PickRequest, priority: int) -> PickRequest | None:
        """``request`` without the pools where a class higher than ``priority`` waits in another replica (the
        request itself when there is none); None when that leaves it no pool."""
        if not self._current():
            return request
        usable, outranked = self.outranked((request.model, request.only_pools, request.excluded_pools), priority)
        if not outranked:
            return request
        if len(outranked) == len(usable):
            return None
        return replace(request, excluded_pools=request.excluded_pools | outranked)
