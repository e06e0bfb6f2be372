"""Leader lease in Redis: of several controllers, only the holder launches, drains, replaces and scales.

``SET key me NX PX ttl`` takes a free lease; the holder renews it with a compare-and-extend script. The
holder counts itself leader only until a local deadline shorter than the TTL (measured from before the
renewal was sent), so two controllers never both believe they lead, even across a slow Redis answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from poolgate.kernel.fleet import FleetKeys, RedisLike

log = logging.getLogger("poolgate.controller.lease")

_ACQUIRE_OR_RENEW = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""

SAFETY = 0.8
"""Share of the TTL during which the holder trusts its lease after a successful renewal."""


class LeaderLease:
    def __init__(self, redis: RedisLike, keys: FleetKeys, holder: str, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        self._key = keys.leader
        self.holder = holder
        self._ttl_ms = max(1, int(ttl_s * 1000))
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
            held = bool(await self._redis.eval(_ACQUIRE_OR_RENEW, 1, self._key, self.holder, str(self._ttl_ms)))
        except (RedisError, OSError) as exc:
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
        with contextlib.suppress(RedisError, OSError):
            await self._redis.eval(_RELEASE, 1, self._key, self.holder)

    async def run(self, stop: asyncio.Event, on_gain: Callable[[], object] | None = None) -> None:
        """Renew every third of the TTL until ``stop``; then release the lease for a quick hand-over."""
        try:
            while not stop.is_set():
                before = self.is_leader()
                await self.renew()
                if self.is_leader() and not before and on_gain is not None:
                    on_gain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._ttl_s / 3)
        finally:
            await self.release()
