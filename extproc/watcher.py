"""Keeps the fleet snapshot and the in-flight counters in step with Redis, through the ``FleetStore``; with
the quota store, extproc's only Redis user.

Three loops under one TaskGroup: refresh (on a change notification or every ``snapshot_refresh_s``; it
re-reads only the workers changed since the last refresh, through a ``FleetView``, and builds a new
snapshot only when something changed or the freshness of a worker moved), listen (the store's change feed,
wakes refresh) and flush (writes in-flight deltas, batched, and the queue
depth per pool for the autoscaler: this replica's count of requests it holds for each pool, rewritten when
it changes and at least every ``QUEUED_REFRESH_S``; the store lets it expire, so the count of a replica
that died fades within seconds). With ``share_reservations`` the flush also publishes this replica's KV
reservations and the refresh reads the other replicas' (``peers``). If Redis is away the last snapshot keeps
serving; that shows once in the
log and in ``redis_up``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.peers import PeerExchange
from extproc.snapshot import FleetSnapshot, build_snapshot, empty_snapshot
from poolgate.kernel.config import ExtprocSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.fleet_view import FleetView
from poolgate.kernel.outage import REDIS_ERRORS, OutageLog, ReturnGrace
from poolgate.kernel.store import FleetStore

log = logging.getLogger(__name__)

QUEUED_REFRESH_S = 1.0
"""A replica's queue count is rewritten at least this often while non-zero (and at once when it changes);
well inside the store's ``QUEUED_TTL_S``."""


def held_per_pool(held: Mapping[Hashable, int], pools: Sequence[PoolSpec]) -> dict[str, int]:
    """Requests held per pool, from the queue's counts per domain ``(model, only_pools, excluded_pools)``.

    A held request counts toward every pool that could take it (pools of its model it may use): each of them,
    grown, would let it run. Domains of another shape are ignored.
    """
    counts = {pool.name: 0 for pool in pools}
    for domain, count in held.items():
        if not (isinstance(domain, tuple) and len(domain) == 3) or count <= 0:
            continue
        model, only, excluded = domain
        for pool in pools:
            if pool.model == model and (only is None or pool.name in only) and pool.name not in (excluded or ()):
                counts[pool.name] += count
    return counts


class FleetWatcher:
    """extproc's view of the fleet: ``snapshot`` for picks, kept current from the store by ``run``."""

    def __init__(
        self,
        store: FleetStore,
        pools: Sequence[PoolSpec],
        settings: ExtprocSettings,
        inflight: InflightTracker,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
        on_refresh: Callable[[], None] | None = None,
        replica_id: str | None = None,
    ) -> None:
        self._store = store
        self._pools = tuple(pools)
        self._settings = settings
        self._inflight = inflight
        self._metrics = metrics
        self._clock = clock
        self._on_refresh = on_refresh
        """Called after each new snapshot (the service wakes requests held for capacity)."""
        self.replica_id = replica_id or os.urandom(6).hex()
        """This extproc replica's field in the ``queued`` hashes."""
        self._held: Callable[[], Mapping[Hashable, int]] | None = None
        self._peers: PeerExchange | None = None
        self._published: dict[str, int] = {}
        self._published_at = float("-inf")
        self._wake = asyncio.Event()
        self._io_lock = asyncio.Lock()
        self._redis_link = OutageLog(log, "redis unreachable (%s); serving the last fleet snapshot and retrying",
                                "redis reachable again; fleet snapshot is live", up_level=logging.WARNING,
                                on_change=lambda up: metrics.redis_up.set(1 if up else 0))
        self._after_outage = ReturnGrace(settings.stale_after_s)
        self._view = FleetView(store, live=True)
        self._alive: dict[str, WorkerRecord] = {}
        """The view's records with ``updated_at`` moved on to the last time the registry vouched for them."""
        self._built_at = float("-inf")
        self.snapshot: FleetSnapshot = empty_snapshot(self._pools, settings.stale_after_s)
        """The current snapshot; replaced whole, never mutated, so a pick always sees one consistent view."""
        self.refreshed = asyncio.Event()
        """Set after the first successful refresh."""
        metrics.snapshot_age_seconds.set_function(lambda: max(0.0, self._clock() - self.snapshot.taken_at))

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._refresh_loop())
            group.create_task(self._listen_loop())
            group.create_task(self._flush_loop())

    async def refresh(self) -> bool:
        """Take the fleet's changes and the in-flight totals once; False (snapshot kept) when Redis fails."""
        try:
            delta = await self._view.sync()
            taken_at = self._clock()
            records = self._vouched(taken_at, delta.full, delta.changed)
            async with self._io_lock:
                totals = await self._store.read_busy()
                self._inflight.apply_remote(totals)
                peers = self._peers
                if peers is not None:
                    await self._store.exchange(lambda pipe: peers.queue_reads(pipe, [r.id for r in records]))
        except REDIS_ERRORS as exc:
            self._redis_link.down(exc)
            return False
        if self._redis_link.up():
            self._after_outage.redis_returned(taken_at)
        records = self._after_outage.fill_in(records, taken_at)
        snapshot = build_snapshot(records, self._pools, taken_at, self._settings.stale_after_s)
        self.snapshot = snapshot
        self._metrics.workers.set(len(snapshot.workers))
        self._metrics.stale_workers.set(snapshot.stale_count())
        self.refreshed.set()
        if self._on_refresh is not None:
            self._on_refresh()
        return True

    def _vouched(self, now: float, full: bool, changed: frozenset[str]) -> list[WorkerRecord]:
        """The view's workers, each ``updated_at`` at least as recent as half the staleness bound ago.

        A worker in the view is alive: its record would have expired (and the view's sync, which first writes
        expiries, would have dropped it) had its heartbeats stopped for a TTL. Heartbeats are not re-read one
        by one, so the time they prove is carried here; a record is copied at most once per half bound."""
        records = self._view.records
        if full:
            self._alive = {}
        for worker_id in changed:
            self._alive.pop(worker_id, None)
        for worker_id in set(self._alive) - set(records):
            del self._alive[worker_id]
        oldest = now - self._settings.stale_after_s / 2
        for worker_id, record in records.items():
            alive = self._alive.get(worker_id, record)
            if alive.updated_at < oldest:
                alive = replace(alive, updated_at=now)
            self._alive[worker_id] = alive
        return [self._alive[worker_id] for worker_id in sorted(self._alive)]

    def publish_queue(self, held: Callable[[], Mapping[Hashable, int]]) -> None:
        """Publish the queue depth that ``held`` reports (domain → requests held) with each flush."""
        self._held = held

    def share_reservations(self, peers: PeerExchange) -> None:
        """Publish this replica's reservations and read the others' through ``peers``."""
        self._peers = peers

    async def leave(self) -> None:
        """A clean stop: the other replicas stop counting this one and its reservations at once."""
        if self._peers is None:
            return
        peers = self._peers

        def queue_leave(pipe: Any) -> Callable[[list[Any]], None]:
            peers.queue_leave(pipe)
            return lambda _results: None

        async with self._io_lock:
            await self._store.exchange(queue_leave)

    def _queued_changes(self) -> dict[str, int]:
        """Pools whose held count must be written now: changed, or due for the periodic refresh."""
        if self._held is None:
            return {}
        counts = held_per_pool(self._held(), self._pools)
        due = self._clock() - self._published_at >= QUEUED_REFRESH_S
        return {pool: n for pool, n in counts.items()
                if n != self._published.get(pool, 0) or (due and n)}

    async def flush(self) -> bool:
        """Write pending in-flight deltas and changed queue depths in one pipeline; deltas are kept for the
        next try on failure."""
        deltas = self._inflight.take_pending()
        queued = self._queued_changes()
        if not deltas and not queued and (self._peers is None or not self._peers.has_writes()):
            return True
        try:
            async with self._io_lock:
                published: Callable[[], None] | None = None

                def queue_peer_writes(pipe: Any) -> None:
                    nonlocal published
                    if self._peers is not None:
                        published = self._peers.queue_writes(pipe)

                await self._store.add_counts(deltas, queued, self.replica_id, also=queue_peer_writes)
                self._inflight.mark_flushed(deltas)
                if published is not None:
                    published()
        except REDIS_ERRORS as exc:
            self._inflight.restore_pending(deltas)
            self._redis_link.down(exc)
            return False
        if queued:
            self._published.update(queued)
            self._published_at = self._clock()
        return True

    async def _refresh_loop(self) -> None:
        period = self._settings.snapshot_refresh_s
        while True:
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=period)
            self._wake.clear()

    async def _listen_loop(self) -> None:
        period = self._settings.snapshot_refresh_s
        while True:
            try:
                async with self._store.changes() as feed:
                    self._wake.set()  # changes may have been missed while unsubscribed
                    while True:
                        if await feed.changes(timeout_s=1.0):
                            self._wake.set()
            except REDIS_ERRORS:
                await asyncio.sleep(period)  # refresh reports the outage; keep retrying quietly

    async def _flush_loop(self, batch_window_s: float = 0.02) -> None:
        """Write in-flight deltas at most every ``batch_window_s``: at high request rates one pipeline carries
        many requests' changes instead of one Redis round trip per request (measured: that round trip was
        the largest CPU cost of a request), and other replicas still see the load within 20 ms."""
        period = self._settings.snapshot_refresh_s
        while True:
            with contextlib.suppress(TimeoutError):  # queue depths are refreshed even when no request ends
                await asyncio.wait_for(self._inflight.dirty.wait(), timeout=QUEUED_REFRESH_S / 2)
            if not await self.flush():
                await asyncio.sleep(period)
                continue
            await asyncio.sleep(batch_window_s)
