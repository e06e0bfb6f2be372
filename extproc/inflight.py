"""Optimistic in-flight accounting per worker, shared with other extproc replicas through Redis.

This replica's own count changes at once (at pick and at stream end) so back-to-back picks spread out;
the deltas go to Redis counters later, batched, off the pick path. The other replicas' share is what Redis
reported at the last sync minus what this replica had sent by then. ``counts`` is what a pick reads.

Sibling processes (``siblings``) tell each other their own counts at once, and how much of them they have
written: their part of the Redis total is replaced by what they told.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping


class InflightTracker:
    def __init__(self) -> None:
        self._local: dict[str, int] = {}
        self._others: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._flushed: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self._totals: Mapping[str, int] = {}
        self._sibling_local: Mapping[str, int] = {}
        self._sibling_flushed: Mapping[str, int] = {}
        self.dirty = asyncio.Event()
        """Set when deltas wait to be written to Redis."""

    @property
    def counts(self) -> Mapping[str, int]:
        """Worker id → in flight across replicas (own exact, others as of the last sync)."""
        return self._counts

    def local(self, worker_id: str) -> int:
        return self._local.get(worker_id, 0)

    def acquire(self, worker_id: str) -> None:
        self._change(worker_id, 1)

    def release(self, worker_id: str) -> None:
        self._change(worker_id, -1)

    def _change(self, worker_id: str, delta: int) -> None:
        self._local[worker_id] = self._local.get(worker_id, 0) + delta
        self._pending[worker_id] = self._pending.get(worker_id, 0) + delta
        self._counts[worker_id] = self._counts.get(worker_id, 0) + delta
        self.dirty.set()

    def take_pending(self) -> dict[str, int]:
        """Deltas to write now; give them back with ``restore_pending`` if the write fails."""
        pending = {w: d for w, d in self._pending.items() if d}
        self._pending = {}
        self.dirty.clear()
        return pending

    def restore_pending(self, deltas: Mapping[str, int]) -> None:
        for worker_id, delta in deltas.items():
            self._pending[worker_id] = self._pending.get(worker_id, 0) + delta
        if deltas:
            self.dirty.set()

    def mark_flushed(self, deltas: Mapping[str, int]) -> None:
        for worker_id, delta in deltas.items():
            self._flushed[worker_id] = self._flushed.get(worker_id, 0) + delta

    def own(self, workers: Collection[str] | None = None) -> dict[str, tuple[int, int]]:
        """Worker id → (this replica's requests there, how many of them it wrote to Redis), on ``workers`` or
        wherever it has any: what its siblings read."""
        local, flushed = self._local, self._flushed
        return {w: (local.get(w, 0), flushed.get(w, 0)) for w in (workers or {*local, *flushed})
                if local.get(w, 0) or flushed.get(w, 0)}

    def apply_remote(self, totals: Mapping[str, int]) -> None:
        """Take the Redis totals read after all flushed deltas landed; workers absent from ``totals`` are
        forgotten unless this replica still has requests on them."""
        self._totals = totals
        self._flushed = {w: n for w, n in self._flushed.items() if w in totals or self._local.get(w)}
        self._local = {w: n for w, n in self._local.items() if n}
        self._recount()

    def apply_siblings(self, local: Mapping[str, int], flushed: Mapping[str, int]) -> None:
        """The siblings' own counts per worker, and what of them they wrote to Redis (``siblings``)."""
        self._sibling_local, self._sibling_flushed = local, flushed
        self._recount()

    def _recount(self) -> None:
        sibling_flushed = self._sibling_flushed
        self._others = {w: max(0, total - self._flushed.get(w, 0) - sibling_flushed.get(w, 0))
                        for w, total in self._totals.items()}
        counts = dict(self._others)
        for part in (self._sibling_local, self._local):
            for worker_id, n in part.items():
                if n:
                    counts[worker_id] = counts.get(worker_id, 0) + n
        self._counts = counts
