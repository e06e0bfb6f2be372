"""Server-directed heartbeat intervals over real HTTP and a real Redis: the registry stretches the interval as
the fleet grows and shortens it as it shrinks, workers beat at the interval they are told, and a registry that
restarts paces the fleet at once and brings no re-registration storm."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controller.registry_api import RegistryApi
from poolgate.kernel.config import Config, parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.heartbeat_client import WorkerHeartbeats
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port

TOKEN = "pace-token"
PREFIX = "pace"
BUDGET_PER_S = 20
"""The registry's heartbeat budget in these tests: 20 calls a second, so a few dozen workers stretch it."""
CONFIG = parse_config({
    "pools": [{"name": "chat", "model": "m1"}],
    "controller": {"heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 0.6, "max_heartbeats_per_s": BUDGET_PER_S,
                   "api_processes": 1},
})


class Registry:
    """A registry API served on a fixed port, which a test can stop and start again (a restart)."""

    def __init__(self, redis: aioredis.Redis, config: Config = CONFIG) -> None:
        self._redis = redis
        self._config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api: RegistryApi | None = None
        self._runner: web.AppRunner | None = None
        self._serving: tuple[asyncio.Event, asyncio.Task[None]] | None = None

    async def start(self) -> RegistryApi:
        """Serve, and say so in Redis as an API process does (``RegistryApi.say_it_serves``)."""
        self.api = RegistryApi(FleetStore(self._redis, PREFIX), TOKEN, self._config.pools, self._config.controller)
        self._runner = web.AppRunner(self.api.app())
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        stop = asyncio.Event()
        self._serving = (stop, asyncio.create_task(self.api.say_it_serves(stop)))
        return self.api

    async def stop(self) -> None:
        if self._serving is not None:
            self._serving[0].set()
            await self._serving[1]
            self._serving = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture()
async def registry(redis_url: str) -> AsyncIterator[Registry]:
    redis = aioredis.from_url(redis_url)
    served = Registry(redis)
    await served.start()
    yield served
    await served.stop()
    await redis.aclose()


def registration(index: int) -> dict[str, object]:
    return {"id": f"w{index:03d}", "pool": "chat", "host": "127.0.0.1", "port": 9000 + index}


class Fleet:
    """Workers that each register and heartbeat on their own, as ``WorkerHeartbeats`` does for a real one."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.workers: dict[int, tuple[WorkerHeartbeats, asyncio.Event, asyncio.Task[None]]] = {}

    def start(self, indices: range) -> None:
        for index in indices:
            client = WorkerHeartbeats(self._url, TOKEN, registration(index), interval_s=0.2, ttl_s=0.6)
            stop = asyncio.Event()
            self.workers[index] = (client, stop, asyncio.create_task(client.run(stop)))

    async def stop(self, indices: range | None = None) -> None:
        chosen = list(self.workers) if indices is None else list(indices)
        for index in chosen:
            self.workers[index][1].set()
        await asyncio.gather(*(self.workers.pop(index)[2] for index in chosen))

    def sum(self, counter: Callable[[WorkerHeartbeats], float]) -> float:
        return sum(counter(client) for client, _, _ in self.workers.values())


async def poll_until(condition: Callable[[], bool], bound_s: float, step_s: float = 0.1) -> float:
    """Seconds until ``condition`` held (polled); fails past ``bound_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < bound_s, f"not reached within {bound_s} s"
        await asyncio.sleep(step_s)
    return time.monotonic() - started


async def beats_per_s(fleet: Fleet, window_s: float) -> float:
    """The fleet's heartbeat calls a second over ``window_s``, as the workers counted them."""
    before = fleet.sum(lambda client: client.stats.heartbeats)
    await asyncio.sleep(window_s)
    return (fleet.sum(lambda client: client.stats.heartbeats) - before) / window_s


async def test_the_interval_grows_with_the_fleet_and_shrinks_when_it_shrinks_and_workers_obey_it(
        registry: Registry) -> None:
    fleet = Fleet(registry.url)
    try:
        fleet.start(range(4))  # 4 workers: well under the budget, the configured 0.2 s
        await poll_until(lambda: fleet.sum(lambda c: c.stats.heartbeats) >= 8, 10)
        small = max(client.stats.interval_s for client, _, _ in fleet.workers.values())
        fleet.start(range(4, 60))  # 60 workers at 20 calls a second: 3 s (up to 3.75 with the jitter)
        await poll_until(lambda: min(c.stats.interval_s for c, _, _ in fleet.workers.values()) >= 2.5, 30)
        large = [client.stats.interval_s for client, _, _ in fleet.workers.values()]
        rate = await beats_per_s(fleet, 8.0)
        print(f"4 workers: interval {small:.2f} s; 60 workers: {min(large):.2f}-{max(large):.2f} s, "
              f"{rate:.1f} heartbeats/s (budget {BUDGET_PER_S}, the configured interval would send 300)")
        assert small < 0.3
        assert rate <= BUDGET_PER_S * 1.25  # the fleet beats as told, not at the configured 0.2 s

        await fleet.stop(range(10, 60))  # the fleet shrinks to 10 (they deregister, as a drained worker is)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            for index in range(10, 60):
                async with http.delete(f"{registry.url}/v1/workers/w{index:03d}") as answer:
                    assert answer.status == 204
        shrunk_in = await poll_until(lambda: max(c.stats.interval_s for c, _, _ in fleet.workers.values()) < 0.7, 30)
        print(f"10 workers: every interval below 0.7 s {shrunk_in:.1f} s after the fleet shrank")
        assert fleet.sum(lambda client: client.stats.registrations) == 10  # nobody expired on the way
    finally:
        await fleet.stop()


async def test_a_restarted_registry_paces_the_fleet_from_its_first_answer(redis_url: str) -> None:
    """The fleet's size comes from Redis: a registry that has taken no call yet (a restart, a failover) hands
    a worker of a 300-worker fleet the 300-worker interval at once, not the configured one."""
    redis = aioredis.from_url(redis_url)
    try:
        store = FleetStore(redis, PREFIX)
        await store.register_many([WorkerRecord(id=f"w{i:03d}", pool="chat", model="m1", host="127.0.0.1",
                                                port=9000 + i) for i in range(300)], ttl_s=60)
        fresh = RegistryApi(store, TOKEN, CONFIG.pools, CONFIG.controller)
        answer = await fresh.heartbeat("w007", b"")
        pace = orjson.loads(answer.body)
        print(f"first answer of a fresh registry over 300 workers: {pace}")
        assert answer.status == 200
        assert 300 / BUDGET_PER_S <= pace["heartbeat_interval_s"] <= 300 / BUDGET_PER_S * 1.25
        assert pace["heartbeat_ttl_s"] > pace["heartbeat_interval_s"]
    finally:
        await redis.aclose()


async def test_a_registry_restart_brings_no_re_registration_storm(registry: Registry, redis_url: str) -> None:
    """The registry is away longer than the workers' TTL, while a reader (as the xDS bridge does) expires the
    overdue: the workers ask again at their pace, the mass-expiry guard keeps them, and when a new registry
    answers they carry on beating without registering again."""
    fleet = Fleet(registry.url)
    reader_redis = aioredis.from_url(redis_url)
    reader_stop = asyncio.Event()

    async def read_like_the_bridge() -> None:
        store, version = FleetStore(reader_redis, PREFIX), 0
        while not reader_stop.is_set():
            version = (await store.poll(version)).version
            await asyncio.sleep(0.1)

    reader = asyncio.create_task(read_like_the_bridge())
    try:
        fleet.start(range(30))
        await poll_until(lambda: fleet.sum(lambda c: c.stats.registrations) == 30, 20)
        await poll_until(lambda: fleet.sum(lambda c: c.stats.heartbeats) >= 60, 30)
        ttl_s = max(client.stats.ttl_s for client, _, _ in fleet.workers.values())
        await registry.stop()
        await asyncio.sleep(2 * ttl_s)  # away past every worker's TTL
        unanswered = fleet.sum(lambda c: c.stats.unanswered)
        api = await registry.start()
        beats_before = {index: client.stats.heartbeats for index, (client, _, _) in fleet.workers.items()}
        back_in = await poll_until(lambda: all(client.stats.heartbeats > beats_before[index]
                                               for index, (client, _, _) in fleet.workers.items()), 30)
        registered = len(await FleetStore(reader_redis, PREFIX).read_fleet())
        print(f"registry away {2 * ttl_s:.1f} s (TTL {ttl_s:.2f} s): {unanswered:.0f} calls unanswered, every "
              f"worker beat again {back_in:.1f} s after the restart, registrations "
              f"{fleet.sum(lambda c: c.stats.registrations):.0f}, {registered} registered")
        assert fleet.sum(lambda c: c.stats.registrations) == 30
        assert registered == 30
        assert api.fleet.last_known == 30
    finally:
        reader_stop.set()
        await reader
        await fleet.stop()
        await reader_redis.aclose()


async def test_a_self_registering_simworker_beats_at_the_interval_the_registry_names(
        registry: Registry, redis_url: str) -> None:
    """``poolgate simworker --register-with``: the worker registers itself and then beats at the registry's
    pace: in a fleet of 300 (15 s at this budget) it does not beat at the configured 0.2 s."""
    redis = aioredis.from_url(redis_url)
    store = FleetStore(redis, PREFIX)
    await store.register_many([WorkerRecord(id=f"w{i:03d}", pool="chat", model="m1", host="127.0.0.1",
                                            port=9000 + i) for i in range(300)], ttl_s=120)
    port = free_port()
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(port), "--worker-id", "self-registered",
        "--register-with", registry.url, "--pool", "chat", "--registry-token", TOKEN)
    try:
        async def registered() -> WorkerRecord | None:
            return (await store.read_workers(["self-registered"]))["self-registered"]

        started = time.monotonic()
        while (record := await registered()) is None:
            assert time.monotonic() - started < 30, "the simworker did not register itself"
            await asyncio.sleep(0.1)
        assert record.port == port
        api = registry.api
        assert api is not None
        batches_before = api.heartbeats.batches
        await asyncio.sleep(3.0)  # 15 configured intervals
        beats = api.heartbeats.batches - batches_before
        print(f"self-registered in {time.monotonic() - started:.1f} s; heartbeats in the next 3 s: {beats} "
              f"(the configured 0.2 s would have sent 15)")
        assert beats <= 1
    finally:
        worker.terminate()
        await worker.wait()
        await redis.aclose()


@pytest.mark.parametrize("batch", [False, True])
async def test_the_ttl_a_heartbeat_is_told_is_the_one_the_registry_keeps(redis_url: str, batch: bool) -> None:
    """A worker's deadline in Redis is the TTL its answer named from the call on: a node batch (shorter
    intervals per worker, so a shorter TTL) and a single heartbeat each keep their own."""
    redis = aioredis.from_url(redis_url)
    try:
        store = FleetStore(redis, PREFIX)
        await store.register_many([WorkerRecord(id=f"w{i:03d}", pool="chat", model="m1", host="127.0.0.1",
                                                port=9000 + i) for i in range(300)], ttl_s=120)
        registry = RegistryApi(store, TOKEN, CONFIG.pools, CONFIG.controller)
        if batch:
            answer = await registry.heartbeat_batch(orjson.dumps({"workers": [{"id": f"w{i:03d}"} for i in range(8)]}))
        else:
            answer = await registry.heartbeat("w000", b"")
        told = orjson.loads(answer.body)["heartbeat_ttl_s"]
        seconds, micros = await redis.time()
        deadline_ms = await redis.zscore(store.keys.fleet + ":fleet:deadlines", "w000")
        kept = deadline_ms / 1000 - (seconds + micros / 1e6)
        print(f"{'node batch of 8' if batch else 'single heartbeat'}: told TTL {told} s, Redis keeps {kept:.2f} s")
        assert told - 0.5 < kept <= told + 0.01
    finally:
        await redis.aclose()
