"""Timers for many short deadlines that seldom fire: one heap per event loop, looked at every ``TICK_S`` by a
single loop timer.

The health monitor sets two deadlines per probe (the answer's, and when the probe gives its round slot back),
16,000 a second at 10,000 workers, and nearly all are cancelled: the probe is answered first. On uvloop each
``loop.call_at`` opens a libuv timer handle, and its cancel closes it again; here a deadline is a heap entry
and its cancel a flag. A callback runs up to ``TICK_S`` after its time (plus the loop's own lateness), which
suits deadlines of 0.1 s and more.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

TICK_S = 0.01
"""How often the heap is looked at while it holds a deadline: a callback runs at most this late."""
COMPACT_AT = 1024
"""Cancelled entries are dropped from the heap once there are this many and they are half of it (a deadline
cancelled long before its time would otherwise stay until that time: 30 s deadlines at 20,000 a second)."""


class CoarseTimer:
    """One deadline; ``cancel`` before it is due and its callback never runs."""

    __slots__ = ("_owner", "args", "callback")

    def __init__(self, owner: CoarseTimers, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._owner = owner
        self.callback: Callable[..., None] | None = callback
        self.args = args

    def cancel(self) -> None:
        if self.callback is not None:
            self.callback = None
            self._owner.cancelled += 1


class CoarseTimers:
    """``call_at`` on ``loop``'s clock, for callers on that loop only (see ``coarse_timers``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[tuple[float, int, CoarseTimer]] = []
        self._order = itertools.count()  # ties never compare two timers
        self._ticking = False
        self.cancelled = 0
        """Cancelled entries still in the heap."""

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> CoarseTimer:
        timer = CoarseTimer(self, callback, args)
        heapq.heappush(self._heap, (when, next(self._order), timer))
        if not self._ticking:
            self._ticking = True
            self._loop.call_later(TICK_S, self._tick)
        return timer

    def __len__(self) -> int:
        return len(self._heap) - self.cancelled

    def _tick(self) -> None:
        heap, now = self._heap, self._loop.time()
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            callback, timer.callback = timer.callback, None
            if callback is None:
                self.cancelled -= 1
                continue
            try:
                callback(*timer.args)
            except Exception as exc:  # as the loop does with a failing callback: report it, keep ticking
                self._loop.call_exception_handler({"message": "coarse timer callback failed", "exception": exc})
        if self.cancelled >= COMPACT_AT and 2 * self.cancelled >= len(heap):
            heap[:] = [entry for entry in heap if entry[2].callback is not None]
            heapq.heapify(heap)
            self.cancelled = 0
        self._ticking = bool(heap)
        if self._ticking:
            self._loop.call_later(TICK_S, self._tick)


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, CoarseTimers] = weakref.WeakKeyDictionary()
_CREATING = threading.Lock()  # loops of several threads (the controller's monitor runs on its own)


def coarse_timers() -> CoarseTimers:
    """The running loop's timers (one heap and one loop timer, however many callers share them)."""
    loop = asyncio.get_running_loop()
    timers = _BY_LOOP.get(loop)
    if timers is None:
        with _CREATING:
            timers = _BY_LOOP.setdefault(loop, CoarseTimers(loop))
    return timers
