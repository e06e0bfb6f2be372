"""The one bridge from Redis to Envoy: the registry's changes, read on every change notification and at least
every ``poll_s``, handed to the xDS server, which rebuilds and pushes only the pools whose endpoints changed.

The bridge keeps its own copy of the fleet (``FleetView`` over identity and state only): a change re-reads
the workers it names, never the whole registry, and a heartbeat or a KV report costs it nothing. Expired
workers are written as changes by the first reader to look, so they leave Envoy within a poll period after
their TTL. While Redis is away Envoy keeps the last endpoints; right after it returns, workers missing from
a Redis that lost its data are kept for a grace period (``ReturnGrace``) until their next heartbeats bring
them back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.fleet_view import RESYNC_S, FleetView
from poolgate.kernel.outage import REDIS_ERRORS, OutageLog, ReturnGrace
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller")

OFF_LOOP_WORKERS = 2000
"""From this fleet size on, the xDS build runs in a worker thread (it takes more than a few ms there)."""


class EndpointSink(Protocol):
    """Takes the whole fleet each time and rebuilds what changed (the xDS server)."""

    def update(self, workers: Sequence[WorkerRecord]) -> object: ...

    async def update_off_loop(self, workers: Sequence[WorkerRecord]) -> object: ...

    @property
    def fallback_due(self) -> bool: ...


async def bridge_fleet_to_xds(store: FleetStore, xds: EndpointSink, *, poll_s: float = 0.25,
                              empty_grace_s: float = 3.0, clock: Callable[[], float] = time.monotonic,
                              resync_s: float = RESYNC_S) -> None:
    """Push the registry to ``xds`` whenever it changed (looked at on every change notification and every
    ``poll_s``), until cancelled."""
    redis = OutageLog(log, "redis unreachable (%s); Envoy keeps the last endpoints",
                      "redis is back; registry watch resumed")
    after_outage = ReturnGrace(empty_grace_s)
    view = FleetView(store, live=False, resync_s=resync_s)
    grace_until = float("-inf")
    pushed = False
    while True:
        try:
            async with store.changes() as feed:
                while True:
                    delta = await view.sync()
                    now = clock()
                    if redis.up():
                        after_outage.redis_returned(now)
                        grace_until = now + empty_grace_s
                    if not pushed or not delta.empty or now <= grace_until + poll_s or xds.fallback_due:
                        workers = after_outage.fill_in(view.workers(), now)
                        if len(workers) >= OFF_LOOP_WORKERS:
                            await xds.update_off_loop(workers)
                        else:
                            xds.update(workers)
                        pushed = True
                    await feed.changes(timeout_s=poll_s)  # expiries publish when swept: poll as well
        except REDIS_ERRORS as exc:
            redis.down(exc)
            await asyncio.sleep(poll_s)
