"""Tasks that talk to a real Redis end when cancelled (``cancel_and_wait``), although redis-py may swallow
a cancel that lands while a command is under way."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio as aioredis

from poolgate.kernel.cancel import cancel_and_wait


async def reading(redis_client: aioredis.Redis) -> None:
    while True:
        await redis_client.hmget("k", ["a"])
        await asyncio.sleep(0.001)


async def test_tasks_reading_redis_end_when_cancelled(redis_client: aioredis.Redis) -> None:
    ran_on = 0
    for _ in range(100):  # one cancel, one wait: how many run on (the measure of the problem, printed)
        task = asyncio.create_task(reading(redis_client))
        await asyncio.sleep(random.uniform(0, 0.005))
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.2)
        ran_on += not done
        await asyncio.wait_for(cancel_and_wait([task]), 5)
        assert task.done()
    tasks = [asyncio.create_task(reading(redis_client)) for _ in range(50)]
    await asyncio.sleep(0.02)
    await asyncio.wait_for(cancel_and_wait(tasks), 5)
    print(f"{ran_on} of 100 tasks ran on after one cancel; every one ended with cancel_and_wait")
    assert all(task.done() for task in tasks)
