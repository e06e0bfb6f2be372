"""The affinity map: session or prompt-prefix key → the worker that last took a request with it.

Bounded, least recently used out first. It is extproc-local state outside the pure pick: the pick reads it
through ``PickContext.affinity``; the service records each placement. Replicas keep separate maps (a
session that lands on another replica simply starts its own entry).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping


class AffinityMap:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, str] = OrderedDict()

    @property
    def entries(self) -> Mapping[Hashable, str]:
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, keys: Iterable[Hashable], worker_id: str) -> None:
        if self.max_entries <= 0:
            return
        entries = self._entries
        for key in keys:
            entries[key] = worker_id
            entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

