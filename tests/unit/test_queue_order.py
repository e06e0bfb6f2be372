"""Class order across extproc replicas: what a replica reports (the best class it holds waiting per pool),
how another reads it through a real Redis, and the servicer leaving a pool to a higher class that waits in
another replica unless its own request's deadline is near."""

from __future__ import annotations

import asyncio
import random

import redis.asyncio as aioredis

from extproc.flow_queue import FlowQueue
from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.peers import PeerExchange, PeerKeys
from extproc.queue_order import REPORT_TTL_S, QueueOrder
from extproc.request import RequestFacts
from extproc.reservations import ReservationBook
from extproc.scheduling import PickRequest, default_scheduler
from extproc.service import Phase
from extproc.snapshot import build_snapshot
from extproc.tenancy import TenantDirectory, key_digest
from poolgate.kernel.config import PoolSpec, SchedulingSettings, parse_config
from poolgate.kernel.fleet import WorkerRecord
from tests.unit.test_extproc_service import CHAT, LIMIT, NOW, Fleet, Rig, kv_worker, pin_of, ready, rig
from tests.unit.test_peer_reservations import exchange as exchange_once
from tests.unit.test_tenancy_service import TENANTS, ask, vip

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="vip", model="llama"),
         PoolSpec(name="code", model="coder"))
ANY_POOL = ("llama", None, frozenset())


def request(priority: int = 1) -> PickRequest:
    return PickRequest(RequestFacts("/v1/chat/completions", "POST", "llama"), 4, 4, 16, "short_chat",
                       priority=priority)


def test_the_queue_reports_its_best_class_per_domain_and_forgets_it_when_it_leaves() -> None:
    queue = FlowQueue((10.0, 10.0, 10.0), 100, lambda: 0.0)
    low = queue.push(ANY_POOL, "a", 2, 10).entry
    high = queue.push(ANY_POOL, "b", 0, 10).entry
    queue.push(("coder", None, frozenset()), "a", 1, 10)
    assert queue.best_waiting() == {ANY_POOL: 0, ("coder", None, frozenset()): 1}
    assert high is not None and low is not None
    queue.take(high)
    assert queue.best_waiting()[ANY_POOL] == 2
    queue.remove(low)
    assert ANY_POOL not in queue.best_waiting()


def test_a_report_names_every_pool_a_waiting_request_may_use() -> None:
    waiting = {ANY_POOL: 1, ("llama", frozenset({"vip"}), frozenset()): 0, ("coder", None, frozenset({"code"})): 0}
    order = QueueOrder(POOLS, lambda: waiting)
    assert order.report() == {"chat": 1, "vip": 0}  # coder's only pool is excluded for that request


def test_a_request_leaves_the_pools_where_a_higher_class_waits_elsewhere() -> None:
    order = QueueOrder(POOLS, dict)
    assert order.narrowed(request(), 1) == request()
    order.apply({"chat": 0})
    narrowed = order.narrowed(request(), 1)
    assert narrowed is not None and narrowed.excluded_pools == {"chat"}  # vip is still open to it
    assert order.narrowed(request(0), 0) == request(0)  # the same class: tenant shares decide, not this
    order.apply({"chat": 0, "vip": 1})
    assert order.narrowed(request(2), 2) is None  # every pool it may use: it waits


def test_reports_not_read_for_too_long_say_nothing() -> None:
    now = [0.0]
    order = QueueOrder(POOLS, dict, clock=lambda: now[0])
    order.apply({"chat": 0, "vip": 0})
    assert order.narrowed(request(), 1) is None
    now[0] += REPORT_TTL_S + 0.1  # Redis went away: the last reports read are too old to hold anyone back
    assert order.narrowed(request(), 1) == request()


async def test_one_replica_reads_the_others_report_and_a_stale_or_withdrawn_one_stops_counting(
        redis_client: aioredis.Redis) -> None:
    now = [1_000.0]
    keys = PeerKeys("order-test")
    waiting = {"a": {ANY_POOL: 0}, "b": {ANY_POOL: 2}}
    orders = {name: QueueOrder(POOLS[:1], lambda name=name: waiting[name]) for name in waiting}  # type: ignore
    peers = {name: PeerExchange(keys, name, ReservationBook(settle_s=0.5), clock=lambda: now[0],
                                queue_order=orders[name]) for name in waiting}

    async def exchange(name: str) -> None:
        await exchange_once(redis_client, peers[name])

    await exchange("a")
    await exchange("b")
    assert orders["b"].narrowed(request(2), 2) is None  # a holds class 0 for chat, b's class 2 waits
    assert orders["a"].narrowed(request(0), 0) == request(0)
    now[0] += REPORT_TTL_S + 0.1  # a stopped writing (killed): its report no longer counts
    await exchange("b")
    assert orders["b"].narrowed(request(2), 2) == request(2)
    await exchange("a")  # a rewrites its unchanged report once it is due
    await exchange("b")
    assert orders["b"].narrowed(request(2), 2) is None
    waiting["a"] = {}  # its class-0 request was placed: the report is withdrawn at the next write
    await exchange("a")
    await exchange("b")
    assert orders["b"].narrowed(request(2), 2) == request(2)
    assert await redis_client.hkeys(keys.waiting) == [b"b"]


def service_with(*workers: WorkerRecord, max_wait_s: float = 5,
                 tenants: list[dict[str, object]] | None = None) -> tuple[Rig, QueueOrder]:
    cfg = parse_config({"pools": [p.model_dump() for p in POOLS], "tenants": TENANTS if tenants is None else tenants})
    settings = SchedulingSettings(max_wait_s=max_wait_s)
    service = rig(default_scheduler(random.Random(0), settings),
                  Fleet(build_snapshot(workers, POOLS, taken_at=NOW, stale_after_s=3)), InflightTracker(), Metrics(),
                  max_request_bytes=LIMIT, scheduling=settings, tenants=TenantDirectory(cfg.tenancy, cfg.tenants),
                  pools=POOLS)
    order = service.servicer.director.queue_order
    assert order is not None
    return service, order


async def test_a_lower_class_waits_while_a_higher_one_waits_in_another_replica() -> None:
    service, order = service_with(ready("w1", 9001))
    order.apply({"chat": 0})  # another replica holds a class-0 request for chat
    low, _ = ask(service, "bronze-key", CHAT)
    assert low.phase is Phase.HELD  # the worker has room, but not for it now
    _, answers = ask(service, "gold-key", CHAT)
    assert pin_of(answers[-1]) == "127.0.0.1:9001"  # class 0 itself goes
    held = asyncio.create_task(service.hold(low))
    await asyncio.sleep(0.25)  # release passes ran meanwhile (polled every 0.1 s): it stays held
    assert not held.done()
    order.apply({})  # that request was placed
    service.capacity_changed.notify()
    assert pin_of(await asyncio.wait_for(held, 1)) == "127.0.0.1:9001"


def test_a_lower_class_takes_a_pool_no_higher_class_waits_for() -> None:
    bronze = [{"name": "bronze", "api_key_sha256": [key_digest("bronze-key")], "priority": "low"}]
    service, order = service_with(kv_worker("w1", 9001, 0.0), vip("v1", 9100), tenants=bronze)
    order.apply({"vip": 0})  # bronze may use chat and vip; vip is wanted elsewhere
    pins = set()
    for _ in range(10):
        state, answers = ask(service, "bronze-key", CHAT)
        pins.add(pin_of(answers[-1]))  # type: ignore[arg-type]
        service.finish(state)
    assert pins == {"127.0.0.1:9001"}


async def test_a_request_near_its_deadline_goes_even_while_a_higher_class_waits_elsewhere() -> None:
    service, order = service_with(ready("w1", 9001), max_wait_s=0.4)
    order.apply({"chat": 0})
    low, _ = ask(service, "bronze-key", CHAT)
    assert low.phase is Phase.HELD
    started = asyncio.get_running_loop().time()
    answer = await asyncio.wait_for(service.hold(low), 2)
    waited = asyncio.get_running_loop().time() - started
    print(f"placed after {waited:.2f} s of a 0.4 s wait bound")
    assert pin_of(answer) == "127.0.0.1:9001"  # placed once urgent (half its wait left), not refused
    assert waited < 0.4
