"""A pool that sleeps its surplus: scaling down drains a worker to sleep (its engine asleep, its record saying so,
Ready again), scaling up wakes it before anything is launched; a pool with standby spares launches them ahead of
need and puts each to sleep once it serves. Real Redis, real simulated engines."""

from __future__ import annotations

import aiohttp
import redis.asyncio as aioredis

from controller.drain import Drainer
from controller.instances import InstanceController
from poolgate.kernel.config import DrainSettings
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore
from simworker.worker import SimWorker
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


class LaunchingWorkers(RunningWorkers):
    """Stands in for the process backend: a launch hands out engines already running in this test's loop; a
    launched worker registers (starts serving) when the test says."""

    def __init__(self, store: FleetStore, idle: list[SimWorker], *workers: str) -> None:
        super().__init__(*workers)
        self.store = store
        self.idle = idle

    async def launch(self, pool: str, count: int = 1) -> list[str]:
        self.launched += count
        engines, self.idle = self.idle[:count], self.idle[count:]
        self.workers += [e.spec.worker_id for e in engines]
        return [e.spec.worker_id for e in engines]

    async def serve(self, engine: SimWorker) -> None:
        await self.store.register(WorkerRecord(id=engine.spec.worker_id, pool="chat", model="sim-llama-3-8b",
                                               host="127.0.0.1", port=engine.spec.port), ttl_s=30)


async def is_sleeping(session: aiohttp.ClientSession, engine: SimWorker) -> bool:
    async with session.get(f"http://127.0.0.1:{engine.spec.port}/is_sleeping") as response:
        return bool((await response.json())["is_sleeping"])


async def test_standby_spares_are_launched_put_to_sleep_and_claimed(redis_client: aioredis.Redis,
                                                                    start_simworker: StartSimWorker) -> None:
    store = FleetStore(redis_client, "standbytest")
    first, *spares = [await start_simworker(enable_sleep_mode=True, wake_up_s=0.05) for _ in range(4)]
    backend = LaunchingWorkers(store, spares, first.spec.worker_id)
    await backend.serve(first)
    drainer = Drainer(store, DrainSettings(grace_s=10, settle_s=0.05, poll_s=0.02))
    instances = InstanceController(store, backend, drainer)  # type: ignore[arg-type]

    launched = await instances.keep_standby("chat", 2, sleep_level=1)
    assert launched == [spares[0].spec.worker_id, spares[1].spec.worker_id]
    assert instances.bound_for_sleep("chat") == set(launched)
    # On their way, the spares are neither the pool's size nor its sleepers, and are not launched twice.
    pool = await instances.workers("chat")
    assert pool.awake == [first.spec.worker_id] and pool.asleep == []
    assert await instances.keep_standby("chat", 2, sleep_level=1) == [] and backend.launched == 2

    await backend.serve(spares[0])  # the first spare's engine serves: drained to sleep
    await instances.keep_standby("chat", 2, sleep_level=1)
    await drainer.wait(spares[0].spec.worker_id)
    async with aiohttp.ClientSession() as session:
        assert await is_sleeping(session, spares[0])
        record = (await store.read_workers([spares[0].spec.worker_id]))[spares[0].spec.worker_id]
        assert record is not None and record.sleep_level == 1 and record.state is WorkerState.READY
        pool = await instances.workers("chat")
        assert [r.id for r in pool.asleep] == [spares[0].spec.worker_id]
        assert pool.bound_for_sleep == [spares[1].spec.worker_id]

        # A rise of two: the sleeper is woken, the spare still starting is claimed, nothing is launched.
        up = await instances.scale("chat", 3, sleep_level=1)
        assert up.woken == (spares[0].spec.worker_id,) and up.claimed == (spares[1].spec.worker_id,)
        assert up.started == () and backend.launched == 2 and not await is_sleeping(session, spares[0])
        await backend.serve(spares[1])
        await instances.keep_standby("chat", 1, sleep_level=1)  # room for one spare again: a new launch
        assert not drainer.draining(spares[1].spec.worker_id)  # claimed: it serves, it is not put to sleep
        assert backend.launched == 3 and instances.bound_for_sleep("chat") == {spares[2].spec.worker_id}

        # A worker draining to sleep is already part of the standby: a fall to two awake launches nothing.
        down = await instances.scale("chat", 2, sleep_level=1)
        assert await instances.keep_standby("chat", 2, sleep_level=1) == [] and backend.launched == 3
        await drainer.wait(down.draining[0])
        assert [r.id for r in (await instances.workers("chat")).asleep] == list(down.draining)
    await drainer.close()


async def test_no_standby_is_kept_for_engines_that_refuse_to_sleep(redis_client: aioredis.Redis,
                                                                   start_simworker: StartSimWorker) -> None:
    store = FleetStore(redis_client, "nosleeptest")
    first, spare, another = [await start_simworker() for _ in range(3)]  # no sleep mode: /sleep is refused
    backend = LaunchingWorkers(store, [spare, another], first.spec.worker_id)
    await backend.serve(first)
    drainer = Drainer(store, DrainSettings(grace_s=10, settle_s=0.05, poll_s=0.02))
    instances = InstanceController(store, backend, drainer)  # type: ignore[arg-type]

    assert await instances.keep_standby("chat", 1, sleep_level=1) == [spare.spec.worker_id]
    await backend.serve(spare)
    await instances.keep_standby("chat", 1, sleep_level=1)  # it serves: drained to sleep, which it refuses
    await drainer.wait(spare.spec.worker_id)
    assert backend.stopped == [spare.spec.worker_id]
    assert await instances.keep_standby("chat", 1, sleep_level=1) == [] and backend.launched == 1
    await drainer.close()


async def test_a_backend_that_does_not_name_its_launches_gets_one_standby_launch(
        redis_client: aioredis.Redis) -> None:
    # As a Kubernetes Deployment: a launch raises the replica count, and the pods' names come later.
    store = FleetStore(redis_client, "unnamedtest")
    backend = RunningWorkers("chat-1")
    drainer = Drainer(store, DrainSettings(grace_s=10, settle_s=0.05, poll_s=0.02))
    instances = InstanceController(store, backend, drainer)  # type: ignore[arg-type]
    assert await instances.keep_standby("chat", 2, sleep_level=1) == [] and backend.launched == 2
    await instances.keep_standby("chat", 2, sleep_level=1)  # its spares cannot be told apart: not launched again
    assert backend.launched == 2
    await drainer.close()
