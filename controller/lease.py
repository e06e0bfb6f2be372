"""Leader lease in Redis: of several controllers, only the holder launches, drains, replaces and scales.

``SET key me NX PX ttl`` takes a free lease; the holder renews it with a compare-and-extend script (both
in ``FleetStore.take_lease``). The
holder counts itself leader only until a local deadline shorter than the TTL (measured from before the
renewal was sent), so two controllers never both believe they lead, even across a slow Redis answer.

The holder renews every third of the TTL; a standby tries every tenth, so when the holder dies without
releasing the lease the standby leads at most a TTL and a tenth after the holder's last renewal (a holder
that stops cleanly releases it, and the standby leads within a tenth of the TTL).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.store import FleetStore

log = logging.getLogger("poolgate.controller.lease")

SAFETY = 0.8
"""Share of the TTL during which the holder trusts its lease after a successful renewal."""

RENEW_SHARE = 1 / 3
"""The holder renews every third of the TTL (two renewals may fail before its trust runs out)."""

STANDBY_SHARE = 1 / 10
"""A standby tries to take the lease every tenth of the TTL (a ``SET NX``: one cheap call)."""


class LeaderLease:
    def __init__(self, store: FleetStore, holder: str, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.holder = holder
        self._ttl_s = ttl_s
        self._clock = clock
        self._valid_until = 0.0

    def is_leader(self) -> bool:
        return self._clock() < self._valid_until

    async def renew(self) -> bool:
        """Take or extend the lease; False when another controller holds it (or Redis is away)."""
        sent_at = self._clock()
        was_leader = self.is_leader()
        try:
            held = await self._store.take_lease(self.holder, self._ttl_s)
        except REDIS_ERRORS as exc:
            log.warning("cannot renew the leader lease (%s)", exc)
            held = False
        self._valid_until = sent_at + SAFETY * self._ttl_s if held else 0.0
        if held and not was_leader:
            log.info("controller %s is the leader", self.holder)
        elif was_leader and not held:
            log.warning("controller %s lost the leader lease", self.holder)
        return held

    async def release(self) -> None:
        self._valid_until = 0.0
        with contextlib.suppress(*REDIS_ERRORS):
            await self._store.release_lease(self.holder)

    async def run(self, stop: asyncio.Event, on_gain: Callable[[], object] | None = None) -> None:
        """Renew (or, as a standby, try to take) the lease until ``stop``; then release it for a quick
        hand-over. ``on_gain`` runs each time this controller becomes the leader."""
        try:
            while not stop.is_set():
                before = self.is_leader()
                await self.renew()
                if self.is_leader() and not before and on_gain is not None:
                    on_gain()
                share = RENEW_SHARE if self.is_leader() else STANDBY_SHARE
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._ttl_s * share)
        finally:
            await self.release()
