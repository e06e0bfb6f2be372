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
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.fleet_view import RESYNC_S, FleetDelta, FleetView
from poolgate.kernel.outage import REDIS_ERRORS, OutageLog, ReturnGrace
from poolgate.kernel.store import FleetStore
from poolgate.kernel.store_scripts import EXPIRY_HOLD_MS

log = logging.getLogger("poolgate.controller")

OFF_LOOP_WORKERS = 2000
"""From this fleet size on, a full look (first push, resync, after an outage) runs in a worker thread: it takes
more than a few ms there. A delta costs its pools' joins only (~6 ms for one pool of 10,000) and stays on the
loop."""


class EndpointSink(Protocol):
    """Takes the whole fleet each time, with the ids that changed when known, and rebuilds what changed (the
    xDS server)."""

    def update(self, workers: Sequence[WorkerRecord] | Mapping[str, WorkerRecord],
               changed: Collection[str] | None = None) -> object: ...

    async def update_off_loop(self, workers: Sequence[WorkerRecord] | Mapping[str, WorkerRecord]) -> object: ...


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
    pushed = look_again = False
    held = 0
    while True:
        try:
            async with store.changes() as feed:
                while True:
                    delta = await view.sync()
                    held = _say_held(view.held, held)
                    now = clock()
                    if redis.up():
                        after_outage.redis_returned(now)
                        grace_until = now + empty_grace_s
                    in_grace = now <= grace_until + poll_s
                    if not pushed or not delta.empty or in_grace or look_again:
                        carried = after_outage.fill_in(view.workers(), now) if in_grace else None
                        await _push(xds, view, delta, carried, whole=not pushed or look_again)
                        pushed, look_again = True, in_grace  # the first push after the grace drops what it kept
                    await feed.changes(timeout_s=poll_s)  # expiries publish when swept: poll as well
        except REDIS_ERRORS as exc:
            redis.down(exc)
            after_outage.fill_in(view.workers(), clock())  # the fleet as it was, carried over if Redis lost it
            await asyncio.sleep(poll_s)


def _say_held(held: int, before: int) -> int:
    """Log when the mass-expiry guard starts and stops holding overdue workers; returns ``held``."""
    if held and not before:
        log.warning("%d workers missed their heartbeats at once: their expiry is held (up to %.0f s) while their "
                    "probes decide whether they serve; is the registry API reachable from the agents?", held,
                    EXPIRY_HOLD_MS / 1000)
    elif before and not held:
        log.info("no more overdue workers held: heartbeats are back, or the rest expired")
    return held


async def _push(xds: EndpointSink, view: FleetView, delta: FleetDelta, carried: list[WorkerRecord] | None,
                whole: bool) -> None:
    """The view to ``xds``: only the workers the delta names, unless everything was read again, ``whole``
    asks for all, or the grace period adds ``carried`` workers; a look at all of a large fleet off the loop."""
    if carried is not None or whole or delta.full:
        workers: Sequence[WorkerRecord] | Mapping[str, WorkerRecord] = carried if carried is not None else view.records
        if len(workers) >= OFF_LOOP_WORKERS:
            await xds.update_off_loop(workers)
        else:
            xds.update(workers)
    else:
        xds.update(view.records, delta.changed)
