"""Incremental fleet state against a real Redis: readers re-read only what changed, catch up on changes
they were not told about, read everything again on a gap or after Redis lost its data, and see expiries;
the xDS bridge rebuilds only the changed pool; the health monitor writes a round's verdicts in one batch."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from controller.health import HealthMemory
from controller.monitor import HealthMonitor
from controller.probe import HttpProber
from controller.xds.build import ENDPOINT_TYPE_URL
from controller.xds.server import XdsServer
from controller.xds_bridge import bridge_fleet_to_xds
from poolgate.kernel.config import HealthSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.fleet_view import FleetView
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.store import ChangeFeed, FleetChange, FleetStore
from poolgate.procs import free_port, stop_process, wait_port

PREFIX = "delta-test"
POOLS = tuple(PoolSpec(name=f"p{i}", model="llama") for i in range(3))


def worker(index: int, pool: str = "p0", port: int = 9000) -> WorkerRecord:
    return WorkerRecord(id=f"w{index}", pool=pool, model="llama", host="127.0.0.1", port=port + index)


async def heard(feed: ChangeFeed, timeout_s: float = 1.0) -> list[FleetChange]:
    """Every notification that arrives within ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    changes: list[FleetChange] = []
    while (left := deadline - loop.time()) > 0:
        changes += await feed.changes(timeout_s=left)
    return changes


async def register(store: FleetStore, *indexes: int, ttl_s: float = 60.0) -> None:
    for index in indexes:
        await store.register(worker(index, pool=f"p{index % 3}"), ttl_s)


async def test_a_reader_re_reads_only_the_worker_that_changed(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, *range(20))
    view = FleetView(store)
    first = await view.sync()
    assert first.full and len(view.records) == 20
    assert await store.set_state("w7", WorkerState.DRAINING)
    delta = await view.sync()
    assert not delta.full and delta.changed == {"w7"}
    assert view.records["w7"].state is WorkerState.DRAINING
    assert (await view.sync()).empty
    assert view.full_reads == 1


async def test_a_heartbeat_that_only_says_alive_changes_nothing_readers_follow(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, 1)
    view = FleetView(store, live=True)
    await view.sync()
    version = view.version
    assert await store.heartbeat("w1", ttl_s=60)
    assert (await view.sync()).empty and view.version == version
    assert await store.heartbeat("w1", ttl_s=60, kv_usage=0.4)  # a live fact: the live log has it
    assert (await view.sync()).changed == {"w1"}
    assert view.records["w1"].kv_usage == pytest.approx(0.4)
    xds_view = FleetView(store, live=False)
    await xds_view.sync()
    assert await store.heartbeat("w1", ttl_s=60, kv_usage=0.6)
    assert (await xds_view.sync()).empty  # identity and state only: a KV report costs it nothing


async def test_changes_made_while_nobody_listened_are_caught_up(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, 1, 2, 3)
    view = FleetView(store)
    await view.sync()
    await store.deregister("w2")  # no subscriber heard any of these
    await register(store, 4)
    await store.set_state("w3", WorkerState.FAILED)
    delta = await view.sync()
    assert not delta.full and delta.changed == {"w2", "w3", "w4"}
    assert sorted(view.records) == ["w1", "w3", "w4"]
    assert view.records["w3"].state is WorkerState.FAILED


async def test_a_gap_in_the_trimmed_change_log_makes_the_reader_read_everything(
        redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, 1)
    behind = FleetView(store)
    await behind.sync()
    churn = [worker(100 + i) for i in range(1100)]  # short-lived workers: their log entries get trimmed
    for record in churn:
        await store.register(record, 60)
        await store.deregister(record.id)
    await register(store, 2)
    await FleetView(store).sync()  # any reader's poll trims the log
    delta = await behind.sync()
    assert delta.full and behind.full_reads == 2
    assert sorted(behind.records) == ["w1", "w2"]


async def test_an_expired_worker_leaves_every_reader_with_one_announcement(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await store.register(worker(1), ttl_s=0.2)
    await register(store, 2)
    view = FleetView(store)
    await view.sync()
    async with store.changes() as feed:
        await asyncio.sleep(0.4)
        delta = await view.sync()
        changes = await heard(feed)
    assert delta.changed == {"w1"} and sorted(view.records) == ["w2"]
    assert [(c.kind, c.worker_id) for c in changes] == [("expire", "w1")]
    assert changes[0].version == view.version
    assert await redis_client.sismember(store.keys.workers, "w1") == 0


async def test_heartbeat_batch_reports_the_workers_that_must_register_again(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, 1, 2)
    missing = await store.heartbeat_many({"w1": {}, "w2": {"state": "Busy"}, "w9": {}}, ttl_s=60)
    assert missing == ["w9"]
    assert {r.id: r.state for r in await store.read_fleet()} == {"w1": WorkerState.READY, "w2": WorkerState.BUSY}


class RestartableRedis:
    """A redis-server that can be stopped and started again on the same port, empty."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="poolgate-redis-delta-")
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed"
        return subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", self.dir],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def start(self) -> None:
        self.proc = await asyncio.to_thread(self._spawn)
        assert await wait_port("127.0.0.1", self.port, 10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@pytest.fixture()
async def restartable() -> AsyncIterator[RestartableRedis]:
    server = RestartableRedis()
    await server.start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


async def test_readers_converge_after_redis_restarts_empty(restartable: RestartableRedis) -> None:
    client = aioredis.from_url(f"redis://127.0.0.1:{restartable.port}/0")
    try:
        store = FleetStore(client, PREFIX)
        await register(store, 1, 2, 3)
        view = FleetView(store)
        await view.sync()
        for _ in range(5):  # push the old version past what the new Redis will reach
            await store.set_state("w1", WorkerState.BUSY)
            await store.set_state("w1", WorkerState.READY)
        restartable.stop()
        await restartable.start()
        with contextlib.suppress(*REDIS_ERRORS):
            await client.ping()  # the old connection is gone: the first call finds out, as in a reader
        await register(store, 2, 4)  # heartbeats find their workers gone and register them again
        delta = await view.sync()
        assert delta.full and sorted(view.records) == ["w2", "w4"]
        await store.set_state("w4", WorkerState.DRAINING)
        assert (await view.sync()).changed == {"w4"}
    finally:
        await client.aclose()


async def test_one_workers_change_rebuilds_only_its_pool(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, *range(9))
    xds = XdsServer(POOLS)
    bridge = asyncio.create_task(bridge_fleet_to_xds(store, xds, poll_s=0.05))
    try:
        async def endpoints_of(pool: str) -> list[tuple[str, int]]:
            snapshot = xds._cache.get(ENDPOINT_TYPE_URL)
            if snapshot is None:
                return []  # the bridge has not read the fleet yet
            assignment = snapshot.resources[f"pool-{pool}"]
            return [(e.endpoint.hostname, e.health_status) for e in assignment.endpoints[0].lb_endpoints]

        for _ in range(100):
            if len(await endpoints_of("p0")) == 3:
                break
            await asyncio.sleep(0.05)
        built = xds.pools_built
        await store.set_state("w4", WorkerState.DRAINING)  # w4 is in p1
        for _ in range(100):
            if ("w4", 3) in await endpoints_of("p1"):  # 3 = DRAINING
                break
            await asyncio.sleep(0.05)
        assert ("w4", 3) in await endpoints_of("p1")
        assert xds.pools_built == built + 1
    finally:
        bridge.cancel()
        await asyncio.gather(bridge, return_exceptions=True)


async def test_a_mass_failure_is_written_in_one_batch_with_one_announcement(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    dead_ports = [free_port() for _ in range(30)]  # nothing listens: every probe is refused
    for i, port in enumerate(dead_ports):
        await store.register(WorkerRecord(id=f"d{i}", pool="p0", model="llama", host="127.0.0.1", port=port), 60)
    settings = HealthSettings(probe_interval_s=0.2, probe_timeout_s=1.0, failures_to_fail=2, check_models=False)
    monitor = HealthMonitor(store, settings, 3.0, HttpProber(1.0, False), spread_s=0.05)
    async with store.changes() as feed:
        await monitor.round()
        await monitor.round()
        changes = await heard(feed)
    states = {r.id: r.state for r in await store.read_fleet()}
    assert set(states.values()) == {WorkerState.FAILED}
    assert monitor.stats.batches == 1 and monitor.stats.transitions == {"Ready->Failed": 30}
    assert [c.kind for c in changes] == ["batch"]
    assert isinstance(monitor.memory("d0"), HealthMemory)
