"""How far behind the controller's event loop runs, so that the registry API puts new work off before the
work it already has (heartbeats) runs late.

A worker expires when its heartbeats stop for a TTL (1.5 s by default). A controller whose loop is saturated
(a fleet of thousands registering at once) answers every request late, heartbeats included: workers expire,
register again, and each registration costs more than the heartbeat it replaced. Measuring the loop's lag
and answering new registrations ``503`` with ``Retry-After`` while it is high breaks that circle: the fleet
joins at the rate the controller can take, and no registered worker is lost to the controller's own delay.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable

PERIOD_S = 0.05
"""The loop is sampled this often (a sleep of this long, and how late it woke)."""
WINDOW_S = 1.0
"""The lag reported is the median of this window's samples: a loop that is behind most of the time, not one
long step (a large xDS build, a full fleet read) that it catches up from."""


class LoopLag:
    """``run`` samples the running loop until cancelled; ``lag_s`` is how late it typically runs now."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()

    async def run(self) -> None:
        while True:
            started = self._clock()
            await asyncio.sleep(PERIOD_S)
            self.record(started + PERIOD_S, self._clock() - started - PERIOD_S)

    def record(self, now: float, lag_s: float) -> None:
        self._samples.append((now, max(0.0, lag_s)))
        while self._samples and self._samples[0][0] < now - WINDOW_S:
            self._samples.popleft()

    @property
    def lag_s(self) -> float:
        return statistics.median(lag for _, lag in self._samples) if self._samples else 0.0
