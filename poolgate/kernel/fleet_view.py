"""``FleetView``: one reader's own copy of the fleet, kept current by re-reading only what changed.

Each ``sync`` asks the store what changed since the view's version (one script call) and re-reads only
those records. It reads everything on its first sync, when the change log cannot answer (the view is older
than the trimmed log, or Redis lost its data: a new epoch or a version that went back), when more changed
than one read may carry, and at least every ``resync_s`` (a safety net that costs one full read per
period, not one per change). A view that follows identity and state only (``live=False``: the xDS
bridge) never re-reads a record for a KV or queue report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore


@dataclass(frozen=True, slots=True)
class FleetDelta:
    """What one ``sync`` changed: ``full`` (everything was read again), or the ids re-read. ``before`` holds
    the records those ids had (None: new), so a reader can tell which pools a change touched."""

    full: bool
    changed: frozenset[str]
    before: Mapping[str, WorkerRecord | None]

    @property
    def empty(self) -> bool:
        return not self.full and not self.changed


READ_WITH_POLL = 64
"""A sync that finds this many changed workers or fewer gets their records with the poll: one round trip to
Redis, not two, for the common change (one worker's), which waited for both on its way to Envoy."""

RESYNC_S = 120.0
"""A view reads everything at least this often, whatever the change log says: the safety net against a change
the log missed. Each full read costs the whole fleet (~0.2 s of a reader's loop at 5,000 workers, which
showed as snapshot-age spikes at a 30 s period), so it comes rarely."""


class FleetView:
    """The registered workers by id, as of the last ``sync``. Redis errors propagate (the view keeps its
    last state: the caller decides what an outage means)."""

    def __init__(self, store: FleetStore, *, live: bool = True, resync_s: float = RESYNC_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._live = live
        self._resync_s = resync_s
        self._clock = clock
        self._records: dict[str, WorkerRecord] = {}
        self._version = -1
        self._epoch: str | None = None
        self._synced_full_at = float("-inf")
        self.full_reads = 0
        """How many times the view read everything (first sync, gaps, periods): for tests and benchmarks."""
        self.held = 0
        """Overdue workers the mass-expiry guard kept registered, as of the last sync (``ChangePoll.held``)."""

    @property
    def records(self) -> Mapping[str, WorkerRecord]:
        return MappingProxyType(self._records)

    @property
    def version(self) -> int:
        return self._version

    def workers(self) -> list[WorkerRecord]:
        """The workers sorted by id (as ``FleetStore.read_fleet`` returns them)."""
        return [self._records[worker_id] for worker_id in sorted(self._records)]

    def mark_stale(self) -> None:
        """Read everything at the next sync (e.g. after a gap in the change feed)."""
        self._version = -1

    async def sync(self) -> FleetDelta:
        now = self._clock()
        poll = await self._store.poll(self._version, live=self._live, read_up_to=READ_WITH_POLL)
        self.held = poll.held
        due = now - self._synced_full_at >= self._resync_s
        gap = self._version < 0 or poll.epoch != self._epoch or poll.changed is None or poll.live is None
        if gap or due:
            return await self._read_all(poll.version, poll.epoch, now)
        ids = sorted(poll.changed | poll.live) if poll.live is not None and poll.changed is not None else []
        if not ids:
            self._version = poll.version
            return FleetDelta(False, frozenset(), {})
        fresh = poll.records if poll.records is not None else await self._store.read_workers(ids)
        before = {worker_id: self._records.get(worker_id) for worker_id in ids}
        for worker_id, record in fresh.items():
            if record is None:
                self._records.pop(worker_id, None)
            else:
                self._records[worker_id] = record
        self._version = poll.version
        return FleetDelta(False, frozenset(ids), before)

    async def _read_all(self, version: int, epoch: str, now: float) -> FleetDelta:
        """Everything again. The version is taken before the read, so a change written during it is read
        again at the next sync (re-reading a record is harmless; missing one is not)."""
        records = await self._store.read_fleet()
        before = dict(self._records)
        self._records = {record.id: record for record in records}
        self._version, self._epoch, self._synced_full_at = version, epoch, now
        self.full_reads += 1
        return FleetDelta(True, frozenset(before) | frozenset(self._records), before)
