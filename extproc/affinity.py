"""The affinity map: session or prompt-prefix key → the worker that last took a request with it.

Bounded, least recently used out first. It is extproc-local state outside the pure pick: the pick reads it
through ``PickContext.affinity``; the service records each placement. Replicas share it: a record that
changes a key's worker is also kept for the peer exchange (``peers``), which publishes it in the next batched
write and applies the other replicas' records on its next read, so a session or prompt prefix follows one
worker whichever extproc process its requests reach (within one refresh, ~0.1 s).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Mapping

MAX_UNPUBLISHED = 50_000
"""Records waiting for the next write; while Redis is away the oldest go first (affinity is a hint)."""


class AffinityMap:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, str] = OrderedDict()
        self._unpublished: deque[tuple[Hashable, str]] = deque(maxlen=MAX_UNPUBLISHED)

    @property
    def entries(self) -> Mapping[Hashable, str]:
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, keys: Iterable[Hashable], worker_id: str) -> None:
        """This replica placed a request with ``keys`` on ``worker_id``."""
        if self.max_entries <= 0:
            return
        entries, unpublished = self._entries, self._unpublished
        for key in keys:
            if entries.get(key) != worker_id:
                unpublished.append((key, worker_id))  # an unchanged key is not sent again
            entries[key] = worker_id
            entries.move_to_end(key)
        self._trim()

    def apply(self, records: Iterable[tuple[Hashable, str]]) -> None:
        """Another replica's placements, in its order (not published again)."""
        if self.max_entries <= 0:
            return
        entries = self._entries
        for key, worker_id in records:
            entries[key] = worker_id
            entries.move_to_end(key)
        self._trim()

    def take_unpublished(self) -> list[tuple[Hashable, str]]:
        records = list(self._unpublished)
        self._unpublished.clear()
        return records

    @property
    def has_unpublished(self) -> bool:
        return bool(self._unpublished)

    def _trim(self) -> None:
        entries = self._entries
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
