"""The fleet's size the registry paces heartbeats to: Redis's count, read before the first answer and then in the
background, plus this process's registrations since."""

from __future__ import annotations

import asyncio

from controller.fleet_count import FleetCount
from tests.manual_clock import ManualClock


class CountingStore:
    def __init__(self, count: int) -> None:
        self.count = count
        self.reads = 0

    async def count_workers(self) -> int:
        self.reads += 1
        return self.count


async def test_the_first_answer_waits_for_redis_count_and_later_ones_do_not() -> None:
    clock = ManualClock()
    store = CountingStore(10_000)
    fleet = FleetCount(store, refresh_s=1.0, clock=clock)
    assert fleet.last_known == 0
    assert await fleet.workers() == 10_000  # a restarted registry knows the whole fleet at once
    store.count = 4000
    assert await fleet.workers() == 10_000 and store.reads == 1  # within the period: no read
    clock.now += 1.0
    assert await fleet.workers() == 10_000  # answered at once; the read runs beside
    await asyncio.sleep(0)
    assert await fleet.workers() == 4000 and store.reads == 2


async def test_registrations_count_until_the_next_read_sees_them() -> None:
    clock = ManualClock()
    store = CountingStore(100)
    fleet = FleetCount(store, refresh_s=1.0, clock=clock)
    await fleet.workers()
    fleet.joined(50)
    assert await fleet.workers() == 150
    store.count = 150
    clock.now += 1.0
    await fleet.workers()
    await asyncio.sleep(0)
    assert fleet.last_known == 150  # not 200: the read replaced what it saw


class SlowStore(CountingStore):
    """A first read that takes a few turns of the loop, as a new connection to Redis does."""

    async def count_workers(self) -> int:
        for _ in range(3):
            await asyncio.sleep(0)
        return await super().count_workers()


async def test_a_fleet_registering_at_once_with_a_fresh_registry_is_counted_once() -> None:
    """Workers registering together before the first read has come back wait for that one read: a read that
    each started for itself would see the others' registrations, already counted, a second time."""
    store = SlowStore(0)
    fleet = FleetCount(store, refresh_s=1.0, clock=ManualClock())

    async def register() -> None:
        await fleet.workers()
        fleet.joined(1)
        store.count += 1  # the registration's write

    await asyncio.gather(*(register() for _ in range(4)))
    assert fleet.last_known == 4
    assert store.reads == 1
