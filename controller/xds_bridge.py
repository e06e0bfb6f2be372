"""The one bridge from Redis to Envoy: the registry, read on every change notification and at least every
``poll_s``, handed to the xDS server, which pushes new endpoints only when their content changed.

Expired workers vanish from the registry and so from Envoy. While Redis is away Envoy keeps the last
endpoints; right after it returns, workers missing from a Redis that lost its data are kept for a grace
period (``ReturnGrace``) until their next heartbeats bring them back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.outage import REDIS_ERRORS, OutageLog, ReturnGrace
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller")


class EndpointSink(Protocol):
    """Takes the whole fleet each time (the xDS server)."""

    def update(self, workers: Sequence[WorkerRecord]) -> object: ...


async def bridge_fleet_to_xds(store: FleetStore, xds: EndpointSink, *, poll_s: float = 0.25,
                              empty_grace_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
    """Push the registry to ``xds`` on every change notification and every ``poll_s``, until cancelled."""
    redis = OutageLog(log, "redis unreachable (%s); Envoy keeps the last endpoints",
                      "redis is back; registry watch resumed")
    after_outage = ReturnGrace(empty_grace_s)
    while True:
        try:
            async with store.changes() as feed:
                while True:
                    workers = await store.read_fleet()
                    now = clock()
                    if redis.up():
                        after_outage.redis_returned(now)
                    xds.update(after_outage.fill_in(workers, now))
                    await feed.changes(timeout_s=poll_s)  # expiries publish nothing: poll as well
        except REDIS_ERRORS as exc:
            redis.down(exc)
            await asyncio.sleep(poll_s)
