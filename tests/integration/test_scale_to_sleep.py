"""A pool that sleeps its surplus: scaling down drains a worker to sleep (its engine asleep, its record saying so,
Ready again), scaling up wakes it before anything is launched. Real Redis, real simulated engines."""

from __future__ import annotations

import aiohttp
import redis.asyncio as aioredis

from controller.drain import Drainer
from controller.instances import InstanceController
from poolgate.kernel.config import DrainSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore
from tests.conftest import StartSimWorker


class RunningWorkers:
    """Stands in for the process backend: the workers already run in this test's loop; launches are noted."""

    def __init__(self, *workers: str) -> None:
        self.workers = list(workers)
        self.launched = 0
        self.stopped: list[str] = []

    def owns(self, worker_id: str) -> bool:
        return worker_id in self.workers

    async def pool_workers(self, pool: str) -> list[str]:
        return list(self.workers)

    async def launch(self, pool: str, count: int = 1) -> list[str]:
        self.launched += count
        return []

    async def stop(self, worker_id: str) -> None:
        self.stopped.append(worker_id)
        self.workers.remove(worker_id)

    async def restart(self, worker_id: str) -> None:
        raise AssertionError("not expected")


async def test_surplus_sleeps_and_is_woken_before_a_launch(redis_client: aioredis.Redis,
                                                           start_simworker: StartSimWorker) -> None:
    store = FleetStore(redis_client, "sleeptest")
    engines = [await start_simworker(enable_sleep_mode=True, wake_up_s=0.05) for _ in range(2)]
    for engine in engines:
        await store.register(WorkerRecord(id=engine.spec.worker_id, pool="chat", model="sim-llama-3-8b",
                                          host="127.0.0.1", port=engine.spec.port), ttl_s=30)
    backend = RunningWorkers(*(e.spec.worker_id for e in engines))
    drainer = Drainer(store, DrainSettings(grace_s=10, settle_s=0.05, poll_s=0.02))
    instances = InstanceController(store, backend, drainer)  # type: ignore[arg-type]

    down = await instances.scale("chat", 1, sleep_level=1)
    [sleeper] = down.draining
    await drainer.wait(sleeper)
    record = (await store.read_workers([sleeper]))[sleeper]
    assert record is not None and record.sleep_level == 1 and record.state is WorkerState.READY
    port = next(e.spec.port for e in engines if e.spec.worker_id == sleeper)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/is_sleeping") as response:
            assert (await response.json())["is_sleeping"] is True
        assert backend.stopped == [] and len(await instances.active_workers("chat")) == 2  # still a process

        up = await instances.scale("chat", 2, sleep_level=1)
        assert up.woken == (sleeper,) and up.started == () and backend.launched == 0 and up.wake_s is not None
        record = (await store.read_workers([sleeper]))[sleeper]
        assert record is not None and record.sleep_level == 0
        async with session.get(f"http://127.0.0.1:{port}/is_sleeping") as response:
            assert (await response.json())["is_sleeping"] is False

        more = await instances.scale("chat", 3, sleep_level=1)  # nobody left asleep: a launch
        assert more.woken == () and backend.launched == 1
    await drainer.close()
