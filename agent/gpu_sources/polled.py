"""A GPU source read over the network: at most once per interval, a failure logged once per outage.

Between reads the agent's ticks get the last reading (at most ``interval_s`` old). A failed read gives
``NO_GPUS`` until the next try, so facts a source can no longer vouch for are not written again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from agent.gpu_sources.reading import NO_GPUS, GpuReading
from poolgate.kernel.errors import UpstreamError

log = logging.getLogger("poolgate.agent.gpu_sources")


class GpuSourceError(UpstreamError):
    """A GPU source did not answer, or answered something that is not what it should."""


class HttpText:
    """``GET`` over one aiohttp session of its own, created on first use (inside the running loop)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def get(self, url: str, params: dict[str, str] | None = None) -> tuple[int, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(url, params=params) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise GpuSourceError(str(exc) or type(exc).__name__) from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class PolledSource:
    """``read_once`` paced to ``interval_s``, with failures turned into ``NO_GPUS`` and one log line."""

    def __init__(self, name: str, read_once: Callable[[], Awaitable[GpuReading]], interval_s: float,
                 http: HttpText, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._read_once = read_once
        self._interval_s = interval_s
        self._http = http
        self._clock = clock
        self._last: GpuReading = NO_GPUS
        self._read_at: float | None = None
        self._failing = False
        self.reads = 0
        self.failures = 0

    async def read(self) -> GpuReading:
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self._interval_s:
            return self._last
        self._read_at = now
        try:
            reading = await self._read_once()
        except GpuSourceError as exc:
            self.failures += 1
            if not self._failing:
                log.warning("cannot read GPUs from %s (%s); workers get no GPU facts from it until it answers",
                            self.name, exc)
                self._failing = True
            self._last = NO_GPUS
            return NO_GPUS
        self.reads += 1
        if self._failing or self.reads == 1:
            log.info("%s: %d GPU(s) on %d node(s), %d pod(s) holding GPUs", self.name, reading.gpu_count,
                     len(reading.nodes), len(reading.pods))
            self._failing = False
        self._last = reading
        return reading

    async def close(self) -> None:
        await self._http.close()
