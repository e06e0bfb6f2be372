"""How many workers the registry serves, for the heartbeat interval it hands out (``controller.heartbeat_interval``).

The count is Redis's (the size of the workers' index), not this process's: a registry API process that has just
started, or a controller that took over from a failed one, has seen no heartbeat yet, yet must hand the whole
fleet's workers the whole fleet's interval from its first answer, or its first answers would ask a large fleet
to beat at the floor and bring about the overload the interval exists to prevent (Nomad's servers, which count
their own in-memory timers, hand out a long fixed TTL after a failover for this reason). It is read before the
first answer, then again at most every ``REFRESH_S`` in the background, so an answer never waits for Redis;
registrations this process took since the last read are added, so a fleet that registers at once is paced
while it does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from poolgate.kernel.outage import REDIS_ERRORS

log = logging.getLogger("poolgate.controller.fleet_count")

REFRESH_S = 1.0
"""The count is read from Redis at most this often (one ``SCARD``)."""


class CountsWorkers(Protocol):
    async def count_workers(self) -> int: ...


class FleetCount:
    """The fleet's size as last read from Redis plus this process's registrations since."""

    def __init__(self, store: CountsWorkers, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._clock = clock
        self._read = 0
        self._joined = 0
        self._read_at: float | None = None
        self._reading: asyncio.Task[None] | None = None

    @property
    def last_known(self) -> int:
        """The count without waiting (0 before the first read)."""
        return self._read + self._joined

    def joined(self, workers: int) -> None:
        """This process registered ``workers`` (counted until the next read sees them)."""
        self._joined += workers

    async def workers(self) -> int:
        """The fleet's size: read from Redis on the first call; later calls answer at once and start a read in
        the background when the last one is older than the refresh period.

        Callers that come while the first read is out wait for that same read: a read each started for itself
        would come back after the others' registrations were written and count them twice (once in Redis's
        count, once as joined since its own start), a fleet registering at once paced as one of twice its size."""
        if self._read_at is None:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.create_task(self._refresh())
            await asyncio.shield(self._reading)
        elif self._clock() - self._read_at >= self._refresh_s and (self._reading is None or self._reading.done()):
            self._reading = asyncio.create_task(self._refresh_quietly())
        return self.last_known

    async def _refresh(self) -> None:
        started = self._clock()
        joined_before = self._joined
        count = await self._store.count_workers()
        self._read, self._joined, self._read_at = count, self._joined - joined_before, started

    async def _refresh_quietly(self) -> None:
        try:
            await self._refresh()
        except REDIS_ERRORS as exc:  # the last count stands; the heartbeats' own writes report the outage
            self._read_at = self._clock()
            log.debug("fleet count not read: %s", exc)
