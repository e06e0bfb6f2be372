"""extproc's fleet picture when Redis comes back without its data: the workers it knew keep serving until
their next heartbeats re-register them, and stop counting once that window has passed."""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.watcher import FleetWatcher
from poolgate.kernel.config import ExtprocSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import FleetStore
from tests.manual_clock import ManualClock

POOLS = (PoolSpec(name="chat", model="llama"),)
KEYS = RedisKeys("redis-return-test")
STALE_AFTER_S = 1.0


class Unpluggable:
    """A Redis client whose server can be made unreachable: every call then fails as a dropped link does."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.unplugged = False

    def __getattr__(self, name: str) -> Any:
        if self.unplugged:
            raise RedisConnectionError("Connection refused")
        return getattr(self.client, name)


async def test_known_workers_stay_ready_after_redis_returns_empty_until_their_heartbeats_are_due(
        redis_client: Any) -> None:
    redis = Unpluggable(redis_client)
    clock = ManualClock()
    watcher = FleetWatcher(FleetStore(redis, KEYS.prefix), POOLS, ExtprocSettings(stale_after_s=STALE_AFTER_S),
                           InflightTracker(), Metrics(), clock=clock)
    store = FleetStore(redis_client, KEYS.prefix)
    await store.register(WorkerRecord(id="w1", pool="chat", model="llama", host="127.0.0.1", port=9001), ttl_s=60)
    [record] = await store.read_fleet()
    clock.now = record.updated_at + 0.2
    assert await watcher.refresh()
    assert [w.id for w in watcher.snapshot.ready_workers_for("llama")] == ["w1"]

    redis.unplugged = True
    clock.now += 2.5  # an outage longer than the staleness bound: the last picture keeps serving
    assert not await watcher.refresh()
    assert [w.id for w in watcher.snapshot.ready_workers_for("llama")] == ["w1"]

    await redis_client.flushdb()  # it returns without its data
    redis.unplugged = False
    clock.now += 0.1
    assert await watcher.refresh()
    assert [w.id for w in watcher.snapshot.ready_workers_for("llama")] == ["w1"], "a known worker was dropped"

    clock.now += STALE_AFTER_S + 0.1  # w1 never re-registered: once the window has passed it is gone
    assert await watcher.refresh()
    assert watcher.snapshot.ready_workers_for("llama") == ()

