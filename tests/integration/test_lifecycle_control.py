"""Leader lease, health monitor, drainer and the operator API over a real Redis (workers are faked)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controller.drain import DrainEnd, Drainer
from controller.health import ProbeResult, Remedy
from controller.instances import InstanceController
from controller.lease import LeaderLease
from controller.monitor import HealthMonitor
from controller.registry_api import RegistryApi
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import FleetStore
from tests.manual_clock import ManualClock

CONFIG = parse_config({
    "pools": [{"name": "chat", "model": "m1"}],
    "health": {"failures_to_fail": 3, "successes_to_ready": 2, "passive_failures_to_fail": 2,
               "replace_failed_after_s": 2.0},
    "drain": {"grace_s": 10, "settle_s": 0.1, "poll_s": 0.02},
    "autoscale": {"pools": {"chat": {"min_workers": 1, "max_workers": 3}}},
})
KEYS = RedisKeys("ctl")
STALE_AFTER_S = CONFIG.extproc.stale_after_s


def fleet(redis_client: aioredis.Redis) -> FleetStore:
    return FleetStore(redis_client, KEYS.prefix)


async def register(redis_client: aioredis.Redis, worker_id: str = "w1") -> None:
    await fleet(redis_client).register(WorkerRecord(id=worker_id, pool="chat", model="m1", host="127.0.0.1",
                                                    port=9001), ttl_s=30)


async def test_only_one_controller_holds_the_lease(redis_client: aioredis.Redis) -> None:
    clock = ManualClock()
    first = LeaderLease(fleet(redis_client), "a", ttl_s=5, clock=clock)
    second = LeaderLease(fleet(redis_client), "b", ttl_s=5, clock=clock)
    assert await first.renew() and first.is_leader()
    assert not await second.renew() and not second.is_leader()
    clock.now += 4.1  # past 80 % of the TTL without a renewal: stop acting before Redis would expire it
    assert not first.is_leader()
    assert await first.renew() and first.is_leader()
    await first.release()
    assert await second.renew() and second.is_leader() and not first.is_leader()


class ScriptedProber:
    def __init__(self) -> None:
        self.ok = True

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        return ProbeResult(self.ok, 0.01, "" if self.ok else "connection refused")

    def hung_up(self) -> list[str]:
        return []


class Remedies:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Remedy]] = []

    async def remedy(self, worker_id: str, remedy: Remedy, reason: str) -> None:
        self.calls.append((worker_id, remedy))


async def state(redis_client: aioredis.Redis) -> WorkerState:
    [record] = await fleet(redis_client).read_fleet()
    return record.state


async def test_monitor_writes_states_and_asks_for_a_replacement(redis_client: aioredis.Redis) -> None:
    await register(redis_client)
    prober, remedies, clock = ScriptedProber(), Remedies(), ManualClock()
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, prober, remedies, clock=clock)
    prober.ok = False
    for _ in range(3):
        await monitor.round()
        clock.now += 0.5
    await monitor.settle()  # the confirming probes a round leaves running
    assert await state(redis_client) is WorkerState.FAILED
    clock.now += 2.0
    await monitor.round()
    assert remedies.calls == [("w1", Remedy.REPLACE)]
    prober.ok = True
    await monitor.round()
    assert await state(redis_client) is WorkerState.FAILED
    await monitor.round()
    assert await state(redis_client) is WorkerState.READY
    assert monitor.stats.transitions == {"Ready->Failed": 1, "Failed->Ready": 1}


class SequenceProber:
    """Answers each probe with the next of ``answers`` (then passes)."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers = answers
        self.calls = 0

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        self.calls += 1
        ok = self.answers.pop(0) if self.answers else True
        return ProbeResult(ok, 0.01, "" if ok else "connection refused")

    def hung_up(self) -> list[str]:
        return []


@pytest.mark.parametrize(("answers", "after"), [
    ([False, False, False], WorkerState.FAILED),  # dead: confirmed right after the round that found it
    ([False, True], WorkerState.READY),  # one failed answer, then a good one: still serving
])
async def test_a_serving_workers_failed_probe_is_confirmed_at_once_not_rounds_later(
        redis_client: aioredis.Redis, answers: list[bool], after: WorkerState) -> None:
    await register(redis_client)
    prober = SequenceProber([True])
    health = CONFIG.health.model_copy(update={"probe_interval_s": 0.1})
    monitor = HealthMonitor(fleet(redis_client), health, STALE_AFTER_S, prober, clock=ManualClock())
    await monitor.round()  # known and serving
    prober.answers = list(answers)
    await monitor.round()
    await monitor.settle()  # its confirmations, begun in that round
    assert await state(redis_client) is after
    assert prober.calls == 1 + len(answers)


class BrokenProber:
    """Its probe raises, as a prober with a bug would, for the workers in ``broken``."""

    def __init__(self) -> None:
        self.broken: set[str] = set()

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        if record.id in self.broken:
            raise RuntimeError("prober bug")
        return ProbeResult(True, 0.01)

    def hung_up(self) -> list[str]:
        return []


async def test_a_probe_that_raises_ends_its_check_with_no_verdict_and_the_round_goes_on(
        redis_client: aioredis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    await register(redis_client, "w1")
    await register(redis_client, "w2")
    prober = BrokenProber()
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, prober, clock=ManualClock())
    await monitor.round()  # both known and serving
    prober.broken = {"w1"}
    for _ in range(4):  # more rounds than failures_to_fail
        await asyncio.wait_for(monitor.round(), 5)
    await monitor.settle()
    assert {r.id: r.state for r in await fleet(redis_client).read_fleet()} == {"w1": WorkerState.READY,
                                                                               "w2": WorkerState.READY}
    assert "prober bug" in caplog.text
    assert monitor.stats.probes == 2 + 4  # w2's probes judged; w1's no verdict at all


async def test_passive_failures_reported_through_redis_eject_at_once(redis_client: aioredis.Redis) -> None:
    await register(redis_client)
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, ScriptedProber(), clock=ManualClock())
    await fleet(redis_client).record_passive_failures({"w1": 5})  # from before the monitor first looked: a baseline
    await monitor.round()
    assert await state(redis_client) is WorkerState.READY
    await fleet(redis_client).record_passive_failures({"w1": 1})
    await fleet(redis_client).record_passive_failures({"w1": 1})
    await monitor.round()
    assert await state(redis_client) is WorkerState.FAILED


async def states(redis_client: aioredis.Redis) -> dict[str, WorkerState]:
    return {record.id: record.state for record in await fleet(redis_client).read_fleet()}


async def test_a_worker_the_data_path_reports_failing_is_failed_out_of_turn(redis_client: aioredis.Redis) -> None:
    for worker_id in ("w1", "w2"):
        await register(redis_client, worker_id)
    prober, clock = SequenceProber([]), ManualClock()
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, prober, clock=clock)
    await monitor.round()  # both known and serving
    await fleet(redis_client).record_passive_failures({"w1": 1})  # below passive_failures_to_fail (2)
    await monitor.watch()
    assert prober.calls == 2 and monitor.stats.out_of_turn == 0
    await fleet(redis_client).record_passive_failures({"w1": 1})
    await monitor.watch()
    assert await states(redis_client) == {"w1": WorkerState.FAILED, "w2": WorkerState.READY}
    assert prober.calls == 2 and monitor.stats.out_of_turn == 1  # the failures decide: no probe waited for
    await monitor.watch()  # the same failures are not counted twice
    assert monitor.stats.out_of_turn == 1
    await monitor.round()
    await monitor.round()
    assert (await states(redis_client))["w1"] is WorkerState.FAILED  # held out, its good probes notwithstanding
    clock.now += CONFIG.health.passive_hold_s
    await monitor.round()
    assert (await states(redis_client))["w1"] is WorkerState.READY  # the hold over, its probes bring it back


async def test_failures_a_passed_probe_came_between_still_add_up_within_the_window(
        redis_client: aioredis.Redis) -> None:
    """A worker that fails every request it gets, but gets few, leaves though it passes every probe."""
    await register(redis_client)
    clock = ManualClock()
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, SequenceProber([]), clock=clock)
    await monitor.round()
    await fleet(redis_client).record_passive_failures({"w1": 1})  # below passive_failures_to_fail (2)
    await monitor.watch()
    clock.now += 1.0
    await monitor.round()  # a passed probe
    assert await state(redis_client) is WorkerState.READY
    clock.now += 1.0
    await fleet(redis_client).record_passive_failures({"w1": 1})
    await monitor.watch()
    assert await state(redis_client) is WorkerState.FAILED
    assert monitor.stats.out_of_turn == 1


async def test_failures_further_apart_than_the_window_do_not_add_up(redis_client: aioredis.Redis) -> None:
    await register(redis_client)
    clock = ManualClock()
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, SequenceProber([]), clock=clock)
    await monitor.round()
    await fleet(redis_client).record_passive_failures({"w1": 1})
    await monitor.watch()
    clock.now += CONFIG.health.passive_window_s + 0.5
    await fleet(redis_client).record_passive_failures({"w1": 1})
    await monitor.watch()
    await monitor.round()
    assert await state(redis_client) is WorkerState.READY
    assert monitor.stats.out_of_turn == 0


async def test_a_reported_worker_leaves_while_a_long_round_waits_to_probe_it(redis_client: aioredis.Redis) -> None:
    for worker_id in ("w1", "w2"):
        await register(redis_client, worker_id)
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, SequenceProber([]), spread_s=2.0)
    await monitor.round()  # both known and serving (w2 probed 1 s into the round)
    second = asyncio.create_task(monitor.round())
    await asyncio.sleep(0.1)
    await fleet(redis_client).record_passive_failures({"w2": 2})
    await monitor.watch()
    assert not second.done(), "the round has yet to probe w2"
    assert (await states(redis_client))["w2"] is WorkerState.FAILED
    await second
    assert (await states(redis_client))["w2"] is WorkerState.FAILED  # one good probe does not bring it back
    assert monitor.stats.transitions == {"Ready->Failed": 1}  # the round, reading w2 from before, wrote it once
class StartsProber(SequenceProber):
    """Passes every probe and notes when each started (the loop's clock)."""

    def __init__(self) -> None:
        super().__init__([])
        self.started: list[float] = []

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        self.started.append(asyncio.get_running_loop().time())
        return await super().probe(record)


async def test_a_round_over_a_large_fleet_starts_probes_at_the_configured_rate_at_most(
        redis_client: aioredis.Redis) -> None:
    """Past ``max_probes_per_s × probe_interval_s / 2`` workers a round stretches rather than probing faster: the
    monitor's CPU is bounded by the rate, not by the fleet's size."""
    for i in range(40):
        await register(redis_client, f"w{i:02d}")
    prober = StartsProber()
    health = CONFIG.health.model_copy(update={"max_probes_per_s": 100.0})
    monitor = HealthMonitor(fleet(redis_client), health, STALE_AFTER_S, prober)
    await monitor.round()
    assert len(prober.started) == 40
    assert prober.started[-1] - prober.started[0] >= 39 / 100 * 0.9  # a late loop only spaces them more


async def test_the_default_probe_rate_probes_10000_workers_within_a_few_seconds() -> None:
    """The default rate is what keeps hung workers' detection within 5 s at 10,000 (a round, then 1.5 s of
    probes) and the monitor within about half a core (~100 µs a probe)."""
    default = parse_config({"pools": [{"name": "chat", "model": "m1"}]}).health
    round_s = 10_000 / default.max_probes_per_s
    assert round_s + default.probe_timeout_s + default.probe_interval_s <= 3.5
    assert default.max_probes_per_s * 100e-6 <= 0.5


async def test_one_read_of_passive_counts_removes_those_of_workers_that_left(redis_client: aioredis.Redis) -> None:
    store = fleet(redis_client)
    await store.record_passive_failures({"w1": 1, "left": 2})
    assert await store.read_passive_failures(prune_to={"w1", "w2"}) == {"w1": 1}
    assert await redis_client.hkeys(store.keys.passive) in ([b"w1"], ["w1"])


async def test_follower_does_nothing(redis_client: aioredis.Redis) -> None:
    await register(redis_client)
    prober = ScriptedProber()
    prober.ok = False
    monitor = HealthMonitor(fleet(redis_client), CONFIG.health, STALE_AFTER_S, prober, is_leader=lambda: False)
    for _ in range(5):
        await monitor.round()
    assert await state(redis_client) is WorkerState.READY


async def test_drain_waits_for_inflight_and_engine_queues(redis_client: aioredis.Redis) -> None:
    await register(redis_client)
    await redis_client.hset(KEYS.inflight, "w1", 1)
    await redis_client.hset(KEYS.worker("w1"), mapping={"running": 1})
    drainer = Drainer(fleet(redis_client), CONFIG.drain)
    stopped = asyncio.Event()

    async def stop() -> None:
        stopped.set()

    assert await drainer.start("w1", DrainEnd.STOP, stop)
    assert await state(redis_client) is WorkerState.DRAINING
    await asyncio.sleep(0.3)
    assert not stopped.is_set()
    await redis_client.hdel(KEYS.inflight, "w1")
    await asyncio.sleep(0.2)
    assert not stopped.is_set()  # the engine still runs one (a stream extproc already let go of)
    await redis_client.hset(KEYS.worker("w1"), mapping={"running": 0})
    reason = await asyncio.wait_for(drainer.wait("w1"), 2)
    assert stopped.is_set() and reason is not None and "nothing in flight" in reason
    assert not await drainer.start("unknown", DrainEnd.STOP, stop)
    assert await fleet(redis_client).read_drains() == {}


class FakeBackend:
    name = "fake"

    def __init__(self) -> None:
        self.workers = ["w1"]
        self.stopped: list[str] = []

    def owns(self, worker_id: str) -> bool:
        return worker_id in self.workers

    async def pool_workers(self, pool: str) -> list[str]:
        return list(self.workers)

    async def launch(self, pool: str, count: int = 1) -> list[str]:
        new = [f"n{len(self.workers) + i}" for i in range(count)]
        self.workers += new
        return new

    async def stop(self, worker_id: str) -> None:
        self.stopped.append(worker_id)
        self.workers.remove(worker_id)

    async def restart(self, worker_id: str) -> None:
        pass


@pytest.fixture()
async def api(redis_client: aioredis.Redis) -> AsyncIterator[tuple[str, FakeBackend]]:
    backend = FakeBackend()
    instances = InstanceController(fleet(redis_client), backend, Drainer(fleet(redis_client), CONFIG.drain))
    registry = RegistryApi(fleet(redis_client), "tok", CONFIG.pools, CONFIG.controller, CONFIG.autoscale.pools,
                           instances)
    runner = web.AppRunner(registry.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", backend
    await instances.drainer.close()
    await runner.cleanup()


async def test_scale_and_drain_through_the_api(redis_client: aioredis.Redis, api: tuple[str, FakeBackend]) -> None:
    base, backend = api
    await register(redis_client)
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer tok"}) as http:
        async with http.post(f"{base}/v1/pools/chat/scale", json={"workers": 9}) as response:
            assert response.status == 400 and "max_workers 3" in (await response.json())["error"]["message"]
        async with http.post(f"{base}/v1/pools/chat/scale", json={"workers": 3}) as response:
            assert response.status == 200 and (await response.json())["started"] == ["n1", "n2"]
        async with http.post(f"{base}/v1/pools/chat/scale", json={"workers": 1}) as response:
            body = await response.json()
            assert response.status == 200 and len(body["draining"]) == 2  # the unregistered ones go first
        assert sorted(backend.stopped) == ["n1", "n2"]
        async with http.post(f"{base}/v1/workers/w1/drain?wait=1") as response:
            assert response.status == 200 and "nothing in flight" in (await response.json())["reason"]
        assert backend.stopped[-1] == "w1"
        async with http.post(f"{base}/v1/workers/ghost/drain") as response:
            assert response.status == 404


async def test_a_drain_the_leader_left_is_finished_by_its_successor(redis_client: aioredis.Redis) -> None:
    """The leader begins a drain and dies before it ends; the controller that takes the lease over finishes
    it (stops the worker once nothing is in flight), the grace period still counted from the first start."""
    await register(redis_client)
    await redis_client.hset(KEYS.inflight, "w1", 1)
    old_backend, new_backend = FakeBackend(), FakeBackend()  # one shared fleet (Kubernetes-like)
    old_leader = InstanceController(fleet(redis_client), old_backend, Drainer(fleet(redis_client), CONFIG.drain))
    assert await old_leader.drain("w1")
    await asyncio.sleep(0.2)
    await old_leader.drainer.close()  # killed mid-drain: its task is gone, the worker stays Draining
    assert await state(redis_client) is WorkerState.DRAINING and old_backend.stopped == []
    successor = InstanceController(fleet(redis_client), new_backend, Drainer(fleet(redis_client), CONFIG.drain))
    assert await successor.resume_drains() == ["w1"]
    assert await successor.resume_drains() == []  # already running: not twice
    assert successor.drainer.history["w1"].started_at < time.monotonic() - 0.15
    await asyncio.sleep(0.2)
    assert new_backend.stopped == []  # still one in flight
    await redis_client.hdel(KEYS.inflight, "w1")
    reason = await asyncio.wait_for(successor.drainer.wait("w1"), 5)
    assert reason is not None and "nothing in flight" in reason
    assert new_backend.stopped == ["w1"] and old_backend.stopped == []
    assert await fleet(redis_client).read_drains() == {}
