"""extproc publishes the requests it holds per pool for the autoscaler: a field per replica in
``{prefix}:queued:{pool}``, written by the watcher's flush (never per request), with a short expiry."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.watcher import QUEUED_REFRESH_S, FleetWatcher, held_per_pool
from poolgate.kernel.config import ExtprocSettings, PoolSpec
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import QUEUED_TTL_S, FleetStore
from tests.manual_clock import ManualClock

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="chat-acme", model="llama"),
         PoolSpec(name="code", model="coder"))
KEYS = RedisKeys("queued-test")


def test_held_requests_count_toward_every_pool_that_could_take_them() -> None:
    held: dict[Hashable, int] = {
        ("llama", None, frozenset({"chat-acme"})): 3,     # any tenant but acme
        ("llama", frozenset({"chat-acme"}), frozenset()): 2,  # acme, restricted to its pool
        ("coder", None, frozenset()): 1,
        "not-a-domain": 9,
    }
    assert held_per_pool(held, POOLS) == {"chat": 3, "chat-acme": 2, "code": 1}


async def test_the_flush_writes_changes_refreshes_the_expiry_and_clears_to_zero(redis_client: Any) -> None:
    clock = ManualClock()
    held: dict[Hashable, int] = {("llama", None, frozenset()): 4}
    store = FleetStore(redis_client, KEYS.prefix)
    watcher = FleetWatcher(store, POOLS, ExtprocSettings(), InflightTracker(), Metrics(), clock=clock,
                           replica_id="replica-a")
    watcher.publish_queue(lambda: held)
    await redis_client.hset(KEYS.queued("chat"), "replica-b", 2)  # another replica's share
    assert await watcher.flush()
    assert await store.read_queued("chat") == 6
    assert await store.read_queued("code") == 0
    assert 0 < await redis_client.pttl(KEYS.queued("chat")) <= QUEUED_TTL_S * 1000

    await redis_client.pexpire(KEYS.queued("chat"), 100_000)
    assert await watcher.flush()  # unchanged and not yet due: no write
    assert await redis_client.pttl(KEYS.queued("chat")) > QUEUED_TTL_S * 1000
    clock.now += QUEUED_REFRESH_S
    assert await watcher.flush()  # due: rewritten with a fresh expiry
    assert await redis_client.pttl(KEYS.queued("chat")) <= QUEUED_TTL_S * 1000

    held.clear()
    assert await watcher.flush()
    assert await redis_client.hgetall(KEYS.queued("chat")) == {b"replica-b": b"2"}
