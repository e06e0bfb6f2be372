"""The prompt blocks this replica's placements made pending on their workers, kept until the peer exchange
writes them for the replicas on other hosts.

A replica's KV index counts a placed prompt's blocks as pending on its worker at once, so that a second request
for the same new document follows the first there before the engine's events confirm the blocks. The processes
of one host tell each other at once (``siblings``); a replica on another host reads them from the peer
exchange's stream (``peers``) one flush and one refresh later. Without them, each replica sent the first
questions about a new document wherever its own view said, and the engines computed the document several times
over. In the virtual-time lab (three H100s, shared documents, replicas exchanging through Redis every 50 ms,
median over five traces of the p99 against one replica's; ``docs/results/lab-2026-12-06``), two replicas went
from 1.15-1.47× to 1.03-1.29× and four from 1.46-1.73× to 1.07-1.57× over the four cells (Poisson and bursts,
85 and 100 %).

Only the blocks the index did not already count on the worker (held or pending) are sent: a session's next
turn or a known document's next question adds a few, a new document all of its own (at most
``siblings.MAX_PENDING_KEYS``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from extproc.siblings import MAX_PENDING_KEYS

MAX_UNSENT = 1024
"""Placements kept while the exchange cannot write (Redis away): the oldest go first, a pending mark is only a
hint and outlives its use after a few seconds anyway."""


class PlacedPrefixes:
    __slots__ = ("_unsent",)

    def __init__(self, max_unsent: int = MAX_UNSENT) -> None:
        self._unsent: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=max_unsent)

    def placed(self, worker_id: str, keys: Sequence[int]) -> None:
        """A placement made these block keys pending on the worker (the ones new there, in prompt order)."""
        if keys:
            self._unsent.append((worker_id, tuple(keys[:MAX_PENDING_KEYS])))

    def take(self) -> list[tuple[str, tuple[int, ...]]]:
        unsent = list(self._unsent)
        self._unsent.clear()
        return unsent

    @property
    def has_unsent(self) -> bool:
        return bool(self._unsent)
