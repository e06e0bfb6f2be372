"""Each worker's data-path failures within the last ``health.passive_window_s``, from the cumulative counts every
Envoy reports (``controller.xds.upstream_failures``, read by the health monitor).

A worker is judged on the failures of the window, whatever its probes said meanwhile. Counted from its last
verdict instead, every passed probe started the count over: a worker that failed every request it got, but got
fewer than ``passive_failures_to_fail`` between two probes (2 a second, probed every 0.5 s), stayed in rotation,
and the benchmark's ten such workers took 13 s to leave in one run where they took 0.3-2.6 s in others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Count:
    total: int
    """The cumulative count last read."""
    floor: int
    """The count before the failures still in the window (or before those not acted on yet)."""
    rises: deque[tuple[float, int]] = field(default_factory=deque)
    """(when read, the count then) for each rise still in the window, oldest first."""


class RecentFailures:
    """Failures per worker within ``window_s``, timed by when a read first showed them."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._counts: dict[str, _Count] = {}

    def read(self, totals: Mapping[str, int], now: float) -> None:
        """The cumulative counts as read at ``now``. A worker that has none is forgotten (its count expired or was
        removed); a count that fell started over, and what it holds now is new."""
        for worker_id, total in totals.items():
            count = self._counts.get(worker_id)
            if count is None or total < count.total:
                count = self._counts[worker_id] = _Count(0, 0)
            if total > count.total:
                count.rises.append((now, total))
                count.total = total
        if len(self._counts) > len(totals):
            for worker_id in [w for w in self._counts if w not in totals]:
                del self._counts[worker_id]

    def workers(self) -> Iterable[str]:
        """The workers with a count."""
        return self._counts.keys()

    def recent(self, worker_id: str, now: float) -> int:
        """The worker's failures within the window ending at ``now`` that were not acted on."""
        count = self._counts.get(worker_id)
        if count is None:
            return 0
        rises = count.rises
        while rises and rises[0][0] <= now - self._window_s:
            count.floor = max(count.floor, rises.popleft()[1])
        return count.total - count.floor

    def acted_on(self, worker_id: str) -> None:
        """The worker was judged on its recent failures, or starts anew (a new registration): they count no more."""
        if (count := self._counts.get(worker_id)) is not None:
            count.floor = count.total
            count.rises.clear()
