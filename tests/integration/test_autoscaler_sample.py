"""The autoscaler's sample of a pool from the real registry: extproc's queue for an empty pool wakes it (between
rounds too), extproc's in-flight counts keep a busy pool from looking idle when the agent's scrape of an engine
is stale, and a standby spare on its way to sleep is not the pool's size although its start-up is learned."""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from controller.autoscaler import Autoscaler
from controller.instances import ScaleResult
from poolgate.kernel.config import AutoscaleSettings, PoolScaling
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore


class Pool:
    """Stands in for the instance controller: the workers the backend runs, and the scale calls it got."""

    def __init__(self, *workers: str) -> None:
        self.workers = list(workers)
        self.scaled: list[tuple[str, int]] = []
        self.spares: list[str] = []
        """Of ``workers``, standby spares on their way to sleep."""

    async def active_workers(self, pool: str) -> list[str]:
        return list(self.workers)

    def bound_for_sleep(self, pool: str) -> set[str]:
        return set(self.spares)

    async def scale(self, pool: str, target: int, sleep_level: int = 0) -> ScaleResult:
        self.scaled.append((pool, target))
        return ScaleResult(pool, len(self.workers), target)


SETTINGS = AutoscaleSettings(enabled=True, down_cooldown_s=0.0, up_sustain_s=0.0,
                             pools={"chat": PoolScaling(min_workers=0, max_workers=3)})


def autoscaler(store: FleetStore, pool: Pool) -> Autoscaler:
    return Autoscaler(store, SETTINGS, pool, CollectorRegistry(), clock=lambda: 100.0)  # type: ignore[arg-type]


async def test_a_request_queued_for_an_empty_pool_wakes_it(redis_client: aioredis.Redis) -> None:
    store, pool = FleetStore(redis_client, "as"), Pool()
    await store.add_counts({}, {"chat": 1}, replica_id="extproc-a")
    scaler = autoscaler(store, pool)
    assert (await scaler.sample("chat", 100.0)).waiting == 1
    await scaler.step()
    assert pool.scaled == [("chat", 1)]


async def test_an_empty_pool_is_woken_between_rounds_once_a_request_waits_for_it(
        redis_client: aioredis.Redis) -> None:
    store, pool = FleetStore(redis_client, "as"), Pool()
    scaler = autoscaler(store, pool)
    await scaler.step()  # a round finds the pool empty and idle
    assert pool.scaled == []
    await scaler.wake_empty()  # nothing waits yet: left as it is
    assert pool.scaled == []
    await store.add_counts({}, {"chat": 1}, replica_id="extproc-a")
    await scaler.wake_empty()  # the first request arrives before the next round
    assert pool.scaled == [("chat", 1)]
    pool.workers = ["chat-1"]  # starting
    await scaler.wake_empty()  # no longer empty: the rounds take it from here
    assert pool.scaled == [("chat", 1)]


async def test_in_flight_requests_count_as_running_when_the_engine_facts_read_zero(
        redis_client: aioredis.Redis) -> None:
    store, pool = FleetStore(redis_client, "as"), Pool("chat-1", "chat-2")
    for worker_id in pool.workers:  # registered, serving; the agent's last scrape says nothing runs
        await store.register(WorkerRecord(id=worker_id, pool="chat", model="m", host="127.0.0.1", port=1,
                                          state=WorkerState.READY), ttl_s=30)
    await store.add_counts({"chat-1": 3, "chat-2": 2}, {}, replica_id="extproc-a")
    scaler = autoscaler(store, pool)
    sample = await scaler.sample("chat", 100.0)
    assert (sample.workers, sample.ready, sample.running) == (2, 2, 5)
    await scaler.step()
    assert pool.scaled == []  # 5 running would not fit on one worker fewer: no scale-down


async def test_a_spare_on_its_way_to_sleep_is_not_the_pools_size_but_teaches_its_start_up(
        redis_client: aioredis.Redis) -> None:
    store, pool = FleetStore(redis_client, "as"), Pool("chat-1", "chat-2")
    pool.spares = ["chat-2"]
    await store.register(WorkerRecord(id="chat-1", pool="chat", model="m", host="127.0.0.1", port=1), ttl_s=30)
    await store.add_counts({"chat-1": 1}, {}, replica_id="extproc-a")
    scaler = autoscaler(store, pool)
    starting = await scaler.sample("chat", 100.0)  # the spare starts: not a worker the pool has
    assert (starting.workers, starting.ready, starting.sleeping) == (1, 1, 0)
    await store.register(WorkerRecord(id="chat-2", pool="chat", model="m", host="127.0.0.1", port=2), ttl_s=30)
    serving = await scaler.sample("chat", 109.0)  # it serves, before it is drained to sleep
    assert (serving.workers, serving.ready, serving.demand) == (1, 1, 1.0)
    assert scaler.startup["chat"].estimate(60.0) == 9.0
