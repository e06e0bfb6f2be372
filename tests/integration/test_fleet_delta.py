"""Incremental fleet state against a real Redis: readers re-read only what changed, catch up on changes
they were not told about, read everything again on a gap or after Redis lost its data, and see expiries;
the xDS bridge rebuilds only the changed pool; the health monitor writes a round's verdicts in one batch."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controller import monitor as monitor_module
from controller.health import HealthMemory, ProbeResult
from controller.monitor import HealthMonitor
from controller.probe import HttpProber
from controller.xds import XdsServer
from controller.xds.build import ENDPOINT_TYPE_URL
from controller.xds_bridge import bridge_fleet_to_xds
from poolgate.kernel import fleet_view as fleet_view_module
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


async def test_a_few_changes_come_with_their_records_in_one_round_trip_and_many_in_two(
        redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker's change, the common case on its way to Envoy, costs a reader one round trip (the poll brings
    the record, read in the same step); past ``READ_WITH_POLL`` changes the records are read apart."""
    store = FleetStore(redis_client, PREFIX)
    await register(store, *range(100))
    view = FleetView(store)
    await view.sync()
    reads: list[int] = []
    read_workers = store.read_workers

    async def counted(worker_ids: list[str]) -> dict[str, WorkerRecord | None]:
        reads.append(len(worker_ids))
        return await read_workers(worker_ids)

    monkeypatch.setattr(store, "read_workers", counted)
    assert await store.set_state("w7", WorkerState.DRAINING)
    await store.deregister("w8")
    delta = await view.sync()
    assert delta.changed == {"w7", "w8"} and reads == []
    assert view.records["w7"].state is WorkerState.DRAINING and "w8" not in view.records
    await store.set_states({f"w{i}": WorkerState.FAILED for i in range(10, 10 + fleet_view_module.READ_WITH_POLL + 1)})
    delta = await view.sync()
    assert len(delta.changed) == fleet_view_module.READ_WITH_POLL + 1 and reads == [len(delta.changed)]
    assert all(view.records[f"w{i}"].state is WorkerState.FAILED for i in range(10, 20))


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


async def test_when_most_of_the_fleet_misses_its_heartbeats_at_once_it_stays_until_they_come_back(
        redis_client: aioredis.Redis) -> None:
    """The registry API stalled (or the agents lost their way to it): expiring everyone would empty Envoy, and
    every worker would register again at once."""
    store = FleetStore(redis_client, PREFIX)
    await register(store, *range(20), ttl_s=0.2)
    view = FleetView(store)
    await view.sync()
    await asyncio.sleep(0.4)
    delta = await view.sync()
    assert not delta.changed and len(view.records) == 20 and view.held == 20
    assert len(await store.read_fleet()) == 20
    assert await store.heartbeat_many({f"w{i}": {} for i in range(20)}, ttl_s=60) == []  # no one registers again
    await view.sync()
    assert view.held == 0


async def test_a_worker_overdue_alone_leaves_though_the_fleet_is_held_otherwise(
        redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, *range(20))
    await store.register(worker(20), ttl_s=0.2)
    view = FleetView(store)
    await view.sync()
    await asyncio.sleep(0.4)
    delta = await view.sync()
    assert delta.changed == {"w20"} and "w20" not in view.records and view.held == 0
    assert await store.heartbeat_many({"w20": {}}, ttl_s=60) == ["w20"]  # told to register again


async def test_a_held_worker_whose_record_ran_out_leaves(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, *range(20), ttl_s=0.2)
    view = FleetView(store)
    await view.sync()
    await asyncio.sleep(0.4)
    await redis_client.pexpire(store.keys.worker("w3"), 1)  # as if its hold had run out
    await asyncio.sleep(0.05)
    delta = await view.sync()
    assert delta.changed == {"w3"} and len(view.records) == 19 and view.held == 20


async def test_heartbeat_batch_reports_the_workers_that_must_register_again(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    await register(store, 1, 2)
    beat_at = time.time()
    missing = await store.heartbeat_many({"w1": {}, "w2": {"state": "Busy", "kv_usage": 0.25}, "w9": {}}, ttl_s=60)
    assert missing == ["w9"]
    records = {r.id: r for r in await store.read_fleet()}
    assert {w: r.state for w, r in records.items()} == {"w1": WorkerState.READY, "w2": WorkerState.BUSY}
    assert records["w2"].kv_usage == 0.25
    # the heartbeat's time is sent once for the batch, and written to every worker in it
    assert all(r.updated_at >= beat_at for r in records.values())


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
        built = xds.assignments_built
        await store.set_state("w4", WorkerState.DRAINING)  # w4 is in p1
        for _ in range(100):
            if ("w4", 3) in await endpoints_of("p1"):  # 3 = DRAINING
                break
            await asyncio.sleep(0.05)
        assert ("w4", 3) in await endpoints_of("p1")
        assert xds.assignments_built == built + 1
    finally:
        bridge.cancel()
        await asyncio.gather(bridge, return_exceptions=True)


async def test_a_mass_failure_is_written_in_one_batch_with_one_announcement(redis_client: aioredis.Redis) -> None:
    store = FleetStore(redis_client, PREFIX)
    dead_ports = [free_port() for _ in range(30)]  # nothing listens: every probe is refused
    for i, port in enumerate(dead_ports):
        await store.register(WorkerRecord(id=f"d{i}", pool="p0", model="llama", host="127.0.0.1", port=port), 60)
    settings = HealthSettings(probe_interval_s=0.2, probe_timeout_s=1.0, failures_to_fail=2, check_models=False)
    monitor = HealthMonitor(store, settings, 3.0, HttpProber(1.0, False), spread_s=0.05, write_every_s=60.0)
    async with store.changes() as feed:
        await monitor.round()
        await monitor.round()
        changes = await heard(feed)
    states = {r.id: r.state for r in await store.read_fleet()}
    assert set(states.values()) == {WorkerState.FAILED}
    assert monitor.stats.batches == 1 and monitor.stats.transitions == {"Ready->Failed": 30}
    assert [c.kind for c in changes] == ["batch"]
    assert isinstance(monitor.memory("d0"), HealthMemory)


async def test_a_long_round_writes_the_failures_it_found_before_it_ends(redis_client: aioredis.Redis) -> None:
    """Probes spread over 2 s (a large fleet's round): the workers found dead in its first part are Failed in
    Redis while it still runs, a batch per write period, not one per worker."""
    store = FleetStore(redis_client, PREFIX)
    for i in range(20):  # nothing listens: every probe is refused
        await store.register(WorkerRecord(id=f"d{i:02d}", pool="p0", model="llama", host="127.0.0.1",
                                          port=free_port()), 60)
    settings = HealthSettings(probe_interval_s=0.2, probe_timeout_s=1.0, failures_to_fail=2, check_models=False)
    monitor = HealthMonitor(store, settings, 3.0, HttpProber(1.0, False), spread_s=2.0, write_every_s=0.2)
    await monitor.round()  # the first round only learns the workers (and finds each failing once)
    loop = asyncio.get_running_loop()
    started = loop.time()
    second = asyncio.create_task(monitor.round())
    first_failed_at = None
    while not second.done():
        states = {r.id: r.state for r in await store.read_fleet()}
        if first_failed_at is None and WorkerState.FAILED in states.values():
            first_failed_at = loop.time() - started
        await asyncio.sleep(0.02)
    await second
    took = loop.time() - started
    print(f"first worker Failed in Redis {first_failed_at} s into a round of {took:.2f} s, "
          f"in {monitor.stats.batches} batches")
    assert first_failed_at is not None and first_failed_at < took - 0.5
    for _ in range(50):  # the round's last batch goes out with the next write period (0.2 s); a loaded host lags
        if {r.state for r in await store.read_fleet()} == {WorkerState.FAILED}:
            break
        await asyncio.sleep(0.02)
    assert {r.state for r in await store.read_fleet()} == {WorkerState.FAILED}
    assert 2 <= monitor.stats.batches < 20 and monitor.stats.transitions == {"Ready->Failed": 20}


async def test_a_worker_whose_process_exits_is_failed_before_its_turn_comes(redis_client: aioredis.Redis) -> None:
    """The worker closes the monitor's kept-alive probe connection as its process goes: the monitor probes it
    at once, out of turn, and fails it, while the other worker, whose connection stays, is left alone."""
    store = FleetStore(redis_client, PREFIX)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    runners = {}
    for worker_id in ("gone", "stays"):
        app = web.Application()
        app.router.add_get("/health", health)
        runners[worker_id] = web.AppRunner(app, access_log=None)
        await runners[worker_id].setup()
        await web.TCPSite(runners[worker_id], "127.0.0.1", 0).start()
        await store.register(WorkerRecord(id=worker_id, pool="p0", model="llama", host="127.0.0.1",
                                          port=runners[worker_id].addresses[0][1]), 60)
    settings = HealthSettings(probe_interval_s=0.2, failures_to_fail=2, check_models=False)
    prober = HttpProber(1.0, False)
    monitor = HealthMonitor(store, settings, 3.0, prober, spread_s=0.0)
    try:
        await monitor.round()  # both serving, each probe connection kept alive
        await monitor.watch()
        assert monitor.stats.hung_up == 0
        await runners["gone"].cleanup()
        loop = asyncio.get_running_loop()
        started = loop.time()
        while (await store.read_fleet())[0].state is not WorkerState.FAILED:
            assert loop.time() - started < 10, "never failed"
            await monitor.watch()
            await asyncio.sleep(0.05)
        print(f"exited worker Failed {loop.time() - started:.2f} s after its process went, without a round")
        assert {r.id: r.state for r in await store.read_fleet()} == {"gone": WorkerState.FAILED,
                                                                      "stays": WorkerState.READY}
        assert monitor.stats.hung_up == 1 and monitor.stats.rounds == 1
    finally:
        prober.close()
        await runners["stays"].cleanup()


@contextlib.asynccontextmanager
async def tcp_workers(count: int, answer: bool) -> AsyncIterator[list[int]]:
    """``count`` listeners; each answers every request 200 (``answer``) or reads and never answers (a hung
    engine: its connection stays open and nothing comes back)."""
    open_writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_writers.append(writer)
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                if answer:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    servers = [await asyncio.start_server(serve, "127.0.0.1", 0) for _ in range(count)]
    try:
        yield [server.sockets[0].getsockname()[1] for server in servers]
    finally:
        for server in servers:
            server.close()
        for writer in open_writers:
            writer.close()


class StartsProber:
    """An ``HttpProber`` that records when each worker's probe started; ``busy_after_s`` after the first, the
    controller's loop is busy for ``busy_s``."""

    def __init__(self, timeout_s: float, busy_s: float, busy_after_s: float = 0.02) -> None:
        self.prober = HttpProber(timeout_s, False)
        self.started: dict[str, float] = {}
        self._busy_s = busy_s
        self._busy_after_s = busy_after_s

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        loop = asyncio.get_running_loop()
        if not self.started:
            loop.call_later(self._busy_after_s, time.sleep, self._busy_s)
        self.started.setdefault(record.id, loop.time())
        return await self.prober.probe(record)

    def hung_up(self) -> list[str]:
        return []


async def test_on_a_late_loop_a_slow_probe_gives_its_slot_back_once_a_later_probe_was_answered(
        redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slots; a hung, b answers at once, c and d hung. The loop is busy from 0.25 to 1.05 s (b has answered
    by then, and c taken its slot), so a's slot timer (due at 0.5 s) fires late: b, started after a, was
    answered, so the wait is a's worker's and a gives its slot back then, and d starts. (Looking at the loop
    alone, a kept its slot another hold: d at 1.55 s.)"""
    monkeypatch.setattr(monitor_module, "SLOT_HOLD_S", 0.5)
    store = FleetStore(redis_client, PREFIX)
    settings = HealthSettings(probe_interval_s=1.0, probe_timeout_s=3.0, failures_to_fail=1, check_models=False)
    prober = StartsProber(3.0, 0.8, busy_after_s=0.25)
    monitor = HealthMonitor(store, settings, 3.0, prober, spread_s=0.0, probe_concurrency=2)
    async with tcp_workers(3, answer=False) as hung, tcp_workers(1, answer=True) as answering:
        for worker_id, port in zip(("a", "c", "d"), hung, strict=True):
            await store.register(WorkerRecord(id=worker_id, pool="p0", model="llama", host="127.0.0.1", port=port), 60)
        await store.register(WorkerRecord(id="b", pool="p0", model="llama", host="127.0.0.1", port=answering[0]), 60)
        try:
            await monitor.round()
        finally:
            prober.prober.close()
    started = {worker_id: at - prober.started["a"] for worker_id, at in prober.started.items()}
    print("probes started at " + ", ".join(f"{w} {at:.2f} s" for w, at in sorted(started.items())))
    assert started["c"] < 0.5  # b was answered at once, and c took its slot
    assert 1.05 <= started["d"] < 1.4  # a's slot: given back when the late timer fired, not a hold later


async def test_hung_workers_do_not_hold_a_rounds_probe_slots(redis_client: aioredis.Redis) -> None:
    """16 hung workers and 8 healthy ones, 2 probe slots: a hung worker's probe gives its slot back once slow,
    so a round lasts about one probe timeout, not 16 timeouts over 2 slots (8 s), and the healthy workers are
    probed while the hung ones wait."""
    store = FleetStore(redis_client, PREFIX)
    settings = HealthSettings(probe_interval_s=0.2, probe_timeout_s=1.0, failures_to_fail=2, check_models=False)
    prober = HttpProber(1.0, False)
    monitor = HealthMonitor(store, settings, 3.0, prober, spread_s=0.0, probe_concurrency=2)
    async with tcp_workers(16, answer=False) as hung, tcp_workers(8, answer=True) as healthy:
        for name, ports in (("hung", hung), ("ok", healthy)):
            for i, port in enumerate(ports):
                await store.register(WorkerRecord(id=f"{name}{i:02d}", pool="p0", model="llama", host="127.0.0.1",
                                                  port=port), 60)
        try:
            loop = asyncio.get_running_loop()
            took = []
            for _ in range(2):  # the first learns the workers (each hung one fails once), the second fails them
                started = loop.time()
                await monitor.round()
                took.append(loop.time() - started)
        finally:
            prober.close()
    print(f"rounds over 16 hung workers on 2 slots took {took[0]:.2f} and {took[1]:.2f} s; "
          f"{monitor.stats.slots_given_back} slots given back")
    states = {r.id: r.state for r in await store.read_fleet()}
    assert {s for i, s in states.items() if i.startswith("hung")} == {WorkerState.FAILED}
    assert {s for i, s in states.items() if i.startswith("ok")} == {WorkerState.READY}
    assert monitor.stats.slots_given_back >= 16  # 32 when the test's loop always kept time
    assert max(took) < 6.0  # each about 1.7 s here; holding the slots, 8 s


class CountingProber:
    """An ``HttpProber`` that counts the probes each worker got, and notes when each started and ended."""

    def __init__(self, timeout_s: float) -> None:
        self.prober = HttpProber(timeout_s, False)
        self.probes: dict[str, int] = {}
        self.spans: dict[str, list[tuple[float, float]]] = {}

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        self.probes[record.id] = self.probes.get(record.id, 0) + 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            return await self.prober.probe(record)
        finally:
            self.spans.setdefault(record.id, []).append((started, loop.time()))

    def hung_up(self) -> list[str]:
        return []


async def test_a_round_does_not_wait_for_a_hung_workers_confirmations(redis_client: aioredis.Redis) -> None:
    """A hung worker needs 3 probes of 0.5 s to time out: its confirming probe (started 0.3 s after the first,
    half an interval) goes on after the round that found it, so the round ends after one timeout and the next
    starts (its other workers are not kept waiting for the confirmation), and that round leaves the hung worker
    to its confirmation."""
    store = FleetStore(redis_client, PREFIX)
    settings = HealthSettings(probe_interval_s=0.6, probe_timeout_s=0.5, failures_to_fail=3, check_models=False)
    prober = CountingProber(0.5)
    monitor = HealthMonitor(store, settings, 3.0, prober, spread_s=0.0)
    async with tcp_workers(1, answer=True) as healthy, tcp_workers(1, answer=False) as hung:
        await store.register(WorkerRecord(id="ok", pool="p0", model="llama", host="127.0.0.1", port=healthy[0]), 60)
        await store.register(WorkerRecord(id="hung", pool="p0", model="llama", host="127.0.0.1", port=hung[0]), 60)
        await store.set_states({"ok": WorkerState.READY, "hung": WorkerState.READY})
        loop = asyncio.get_running_loop()
        try:
            await monitor.round()  # learns both workers: the hung one fails its first probe
            started = loop.time()
            await monitor.round()  # its second timeout: the third, confirming, follows on its own
            took = loop.time() - started
            failed_at_round_end = (await store.read_workers(["hung"]))["hung"].state is WorkerState.FAILED
            probes_before = prober.probes["hung"]
            started = loop.time()
            await monitor.round()  # while they run, the next round probes only the healthy worker
            took_next = loop.time() - started
            next_round_probes = prober.probes["hung"] - probes_before
            await monitor.settle()
        finally:
            prober.prober.close()
    print(f"the round that found the hung worker took {took:.2f} s (with its confirmation: 0.8 s), "
          f"the next {took_next:.2f} s")
    states = {r.id: r.state for r in await store.read_fleet()}
    assert states == {"ok": WorkerState.READY, "hung": WorkerState.FAILED}
    assert not failed_at_round_end and took < 0.9 and took_next < 0.4
    assert next_round_probes <= 1  # at most the confirmation under way, never a second check of its own


@contextlib.asynccontextmanager
async def pausable_worker() -> AsyncIterator[tuple[int, list[float]]]:
    """A listener that answers every request 200, but not before ``paused[0]`` (loop time): each connection
    waits on its own, as a worker whose engine pauses answers every probe once the pause is over."""
    open_writers: list[asyncio.StreamWriter] = []
    handlers: list[asyncio.Task[None]] = []
    paused = [0.0]
    closing = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        open_writers.append(writer)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError):
            while not closing.is_set() and await reader.read(4096):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(closing.wait(), max(0.0, paused[0] - loop.time()))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], paused
    finally:
        closing.set()
        server.close()
        for writer in open_writers:
            writer.close()
        await asyncio.gather(*handlers, return_exceptions=True)


async def test_a_hung_workers_confirming_probes_overlap_and_a_paused_one_stays(redis_client: aioredis.Redis) -> None:
    """At the default timing (probes 1 s, interval 0.5 s, 3 failures): a serving worker that stops answering
    gets its confirming probes 0.25 s apart while the first is still out, and is Failed once the third times
    out (1.5 s after the first started, not three timeouts one after the other: 3 s). A worker that pauses
    1.25 s misses its first probe but answers the second (out at once with the third): it stays Ready."""
    store = FleetStore(redis_client, PREFIX)
    settings = HealthSettings(probe_interval_s=0.5, probe_timeout_s=1.0, failures_to_fail=3, check_models=False)
    prober = CountingProber(1.0)
    monitor = HealthMonitor(store, settings, 3.0, prober, spread_s=0.0)
    async with pausable_worker() as (hung_port, hung), pausable_worker() as (paused_port, paused):
        for worker_id, port in (("hung", hung_port), ("paused", paused_port)):
            await store.register(WorkerRecord(id=worker_id, pool="p0", model="llama", host="127.0.0.1",
                                              port=port), 60)
        await store.set_states({"hung": WorkerState.READY, "paused": WorkerState.READY})
        loop = asyncio.get_running_loop()
        try:
            await monitor.round()  # both answer: known and serving
            started = loop.time()
            hung[0], paused[0] = started + 3600, started + 1.25
            await monitor.round()
            await monitor.settle()  # the confirmations, and the write of their verdict
            took = loop.time() - started
        finally:
            prober.prober.close()
    spans = prober.spans["hung"][1:]
    starts = sorted(start - started for start, _ in spans)
    print(f"hung worker Failed {took:.2f} s after the round began; its probes started at "
          f"{', '.join(f'{s:.2f}' for s in starts)} s; the paused worker got {len(prober.spans['paused']) - 1}")
    assert {r.id: r.state for r in await store.read_fleet()} == {"hung": WorkerState.FAILED,
                                                                  "paused": WorkerState.READY}
    assert len(spans) == 3
    assert starts[2] < min(end for _, end in spans) - started  # all three were out at once
    # its first probe timed out, the second passed once the pause was over (the third, still out, was let go)
    assert len(prober.spans["paused"]) == 1 + 3


class BusyLoopProber:
    """An ``HttpProber`` whose first probe is followed by 0.2 s in which the controller's loop is busy."""

    def __init__(self) -> None:
        self.prober = HttpProber(1.0, False)
        self.started: list[float] = []

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        loop = asyncio.get_running_loop()
        self.started.append(loop.time())
        if len(self.started) == 1:
            loop.call_later(0.02, time.sleep, 0.2)
        return await self.prober.probe(record)

    def hung_up(self) -> list[str]:
        return []


async def round_on_one_slot(redis_client: aioredis.Redis, prober: BusyLoopProber | StartsProber, hung: int,
                            probe_timeout_s: float) -> None:
    """One round of a monitor with one probe slot over ``hung`` workers that never answer."""
    store = FleetStore(redis_client, PREFIX)
    settings = HealthSettings(probe_interval_s=0.2, probe_timeout_s=probe_timeout_s, failures_to_fail=2,
                              check_models=False)
    monitor = HealthMonitor(store, settings, 3.0, prober, spread_s=0.0, probe_concurrency=1)
    async with tcp_workers(hung, answer=False) as ports:
        for i, port in enumerate(ports):
            await store.register(WorkerRecord(id=f"hung{i}", pool="p0", model="llama", host="127.0.0.1",
                                              port=port), 60)
        try:
            await monitor.round()
        finally:
            prober.prober.close()


async def test_a_slow_probe_keeps_its_slot_while_the_controller_is_late(redis_client: aioredis.Redis) -> None:
    """On a loop running late, a probe's wait may be the controller's own: it keeps its slot (more probes in
    flight would only make the controller later). Once the loop keeps time again, the slow probe gives it back,
    long before its timeout."""
    prober = BusyLoopProber()
    await round_on_one_slot(redis_client, prober, hung=2, probe_timeout_s=1.0)
    first, second = prober.started
    print(f"second probe started {second - first:.2f} s after the first (busy loop 0.02-0.22 s, timeout 1 s)")
    assert second - first >= 0.3  # kept through the busy loop, and one hold after it (0.1 s)
    assert second - first < 0.8  # given back once the loop kept time, not held until the timeout


async def test_on_a_loop_late_at_every_look_a_slow_probe_gives_its_slot_back_at_the_last_look(
        redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers that hang at the head of a round, on a controller late at every look: each probe keeps its slot
    only ``MAX_LOOKS`` holds (0.3 s), not its whole timeout (hung workers would leave in waves a timeout apart)."""
    monkeypatch.setattr(monitor_module, "LOOP_LATE_S", -1.0)  # every look finds the loop late
    prober = StartsProber(2.0, 0.0)
    await round_on_one_slot(redis_client, prober, hung=3, probe_timeout_s=2.0)
    starts = sorted(prober.started.values())
    print("probes started at " + ", ".join(f"{at - starts[0]:.2f} s" for at in starts) + " (timeout 2 s)")
    assert 0.25 <= starts[1] - starts[0] < 1.0 and 0.25 <= starts[2] - starts[1] < 1.0
