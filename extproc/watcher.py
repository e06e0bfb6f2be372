"""Keeps the fleet snapshot and the in-flight counters in step with Redis, through the ``FleetStore``; with
the quota store, extproc's only Redis user.

Three loops under one TaskGroup: refresh (on a change notification or every ``snapshot_refresh_s``; it
re-reads only the workers changed since the last refresh, through a ``FleetView``, and hands them to a
``FleetIndex``, which updates only the served names they touch and keeps the snapshot object when nothing
in it changed), listen (the store's change feed,
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
from typing import Any

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.peers import PeerExchange
from extproc.queue_order import domain_pools
from extproc.snapshot import FleetIndex, FleetSnapshot
from poolgate.kernel.config import ExtprocSettings, PoolSpec
from poolgate.kernel.fleet_view import FleetView
from poolgate.kernel.outage import REDIS_ERRORS, OutageLog, ReturnGrace
from poolgate.kernel.store import FleetStore

log = logging.getLogger(__name__)

FLUSH_BATCH_S = 0.02
"""The flush loop writes at most this often (one pipeline for many requests' changes)."""
ROUND_TRIPS_S = 0.02
"""Margin for the write's and the read's Redis round trips in ``FleetWatcher.exchange_s``."""
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
        for pool in domain_pools(domain, pools) if count > 0 else ():
            counts[pool] += count
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
        """Called after each successful refresh, whether or not the snapshot changed: the in-flight totals
        it read may have freed capacity (the service wakes requests held for it)."""
        self.replica_id = replica_id or os.urandom(6).hex()
        """This extproc replica's field in the ``queued`` hashes."""
        self._held: Callable[[], Mapping[Hashable, int]] | None = None
        self._peers: PeerExchange | None = None
        self._published: dict[str, int] = {}
        self._published_at = float("-inf")
        self._wake = asyncio.Event()
        self._flush_wake = asyncio.Event()
        self._io_lock = asyncio.Lock()
        self._redis_link = OutageLog(log, "redis unreachable (%s); serving the last fleet snapshot and retrying",
                                "redis reachable again; fleet snapshot is live", up_level=logging.WARNING,
                                on_change=lambda up: metrics.redis_up.set(1 if up else 0))
        self._after_outage = ReturnGrace(settings.stale_after_s)
        self._view = FleetView(store, live=True)
        self._unapplied: set[str] = set()
        """Workers the view re-read that the index has not been given yet (a refresh failed after the sync)."""
        self._carrying = False
        """Redis came back without workers it had: ``ReturnGrace`` carries them over for now."""
        self._index = FleetIndex(self._pools, settings.stale_after_s, vouched=True)
        self.snapshot: FleetSnapshot = self._index.snapshot
        """The current snapshot; replaced whole, never mutated, so a pick always sees one consistent view."""
        self.synced_at = 0.0
        """When the last successful refresh read the fleet: the snapshot is that old (a snapshot kept because
        nothing changed still holds the fleet as of then)."""
        self.refreshed = asyncio.Event()
        """Set after the first successful refresh."""
        metrics.snapshot_age_seconds.set_function(lambda: max(0.0, self._clock() - self.synced_at))

    def start(self) -> list[asyncio.Task[None]]:
        """Start the refresh, change-feed and flush loops; the caller stops them with ``cancel_and_wait``.

        Plain tasks, not a ``TaskGroup``: a loop inside a Redis command can swallow its cancel (see
        ``poolgate.kernel.cancel``), and a group that is already aborting never cancels its children again, so
        one swallowed cancel kept the process alive until its stop deadline killed it."""
        loops = (self._refresh_loop, self._listen_loop, self._flush_loop)
        return [asyncio.create_task(loop(), name=f"fleet-{loop.__name__.strip('_')}") for loop in loops]

    async def refresh(self) -> bool:
        """Take the fleet's changes and the in-flight totals once; False (snapshot kept) when Redis fails.

        Costs the changed workers (and the tuples of the served names they answer to), never the fleet: a
        worker in the view is alive (its record would have expired, and the view's sync, which first writes
        expiries, would have dropped it, had its heartbeats stopped for a TTL), so the snapshot is built
        ``vouched`` and no worker turns stale for want of a re-read heartbeat. A snapshot in which nothing
        changed is kept, and re-dated (a copy, not a rebuild) once it is half the staleness bound old, so
        what waits on a worker being seen (``FleetSnapshot.seen_at``) moves on without a change."""
        try:
            delta = await self._view.sync()
            self._unapplied |= delta.changed
            synced_at = self._clock()
            async with self._io_lock:
                totals = await self._store.read_busy()
                self._inflight.apply_remote(totals)
                peers = self._peers
                if peers is not None:
                    known = self._view.records
                    await self._store.exchange(lambda pipe: peers.queue_reads(pipe, known))
        except REDIS_ERRORS as exc:
            self._redis_link.down(exc)
            return False
        if self._redis_link.up():
            # ReturnGrace carries over what it was last shown: show it the fleet as it was before the outage
            self._after_outage.fill_in(self.snapshot.workers, self.synced_at)
            self._after_outage.redis_returned(synced_at)
            self._carrying = True
        changes = {worker_id: self._view.records.get(worker_id) for worker_id in self._unapplied}
        self._unapplied = set()
        if self._carrying:
            listed = self._view.records.values()
            records = self._after_outage.fill_in(list(listed), synced_at)
            self._carrying = len(records) > len(listed)
            snapshot = self._index.replace(records, synced_at)
        else:
            renew = synced_at - self.snapshot.taken_at >= self._settings.stale_after_s / 2
            snapshot = self._index.update(changes, synced_at, renew=renew)
        self.synced_at = synced_at
        if snapshot is not self.snapshot:
            self.snapshot = snapshot
            self._metrics.workers.set(len(snapshot.by_id))
            self._metrics.stale_workers.set(snapshot.stale_workers)
        self.refreshed.set()
        if self._on_refresh is not None:
            self._on_refresh()
        return True

    @property
    def exchange_s(self) -> float:
        """How long a placement here may stay unseen by another replica: it is written within one flush batch
        and read at the other's next refresh (``snapshot_refresh_s``), plus the round trips."""
        return FLUSH_BATCH_S + self._settings.snapshot_refresh_s + ROUND_TRIPS_S

    def flush_soon(self) -> None:
        """Something to publish changed besides in-flight counts (the queue): flush within the batch window."""
        self._flush_wake.set()

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

    async def _writes_due(self, timeout_s: float) -> None:
        """Until in-flight deltas wait to be written, ``flush_soon`` was called, or ``timeout_s`` passed."""
        events = (self._inflight.dirty, self._flush_wake)
        if any(event.is_set() for event in events):
            return
        waits = [asyncio.ensure_future(event.wait()) for event in events]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _flush_loop(self, batch_window_s: float = FLUSH_BATCH_S) -> None:
        """Write in-flight deltas at most every ``batch_window_s``: at high request rates one pipeline carries
        many requests' changes instead of one Redis round trip per request (measured: that round trip was
        the largest CPU cost of a request), and other replicas still see the load within 20 ms."""
        period = self._settings.snapshot_refresh_s
        while True:
            await self._writes_due(timeout_s=QUEUED_REFRESH_S / 2)  # queue depths are refreshed even when idle
            self._flush_wake.clear()
            if not await self.flush():
                await asyncio.sleep(period)
                continue
            await asyncio.sleep(batch_window_s)
