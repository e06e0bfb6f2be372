"""The one loop shape of the controller's periodic duties (health rounds, adapter sync, pod sync, scaling):
a step every interval until stopped, where a failure of Redis or of a worker only delays the next step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from poolgate.kernel.outage import REDIS_ERRORS


async def every(interval_s: float, stop: asyncio.Event, step: Callable[[], Awaitable[object]],
                on_error: Callable[[Exception], object], *,
                errors: tuple[type[Exception], ...] = REDIS_ERRORS,
                count_step: bool = False) -> None:
    """Run ``step`` until ``stop`` is set, waiting ``interval_s`` after each (``count_step``: from each
    step's start, so a step that overruns is followed at once by the next). ``errors`` go to ``on_error``."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            await step()
        except errors as exc:
            on_error(exc)
        spent = time.monotonic() - started if count_step else 0.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, interval_s - spent))
