"""The node agent's batch heartbeat over real HTTP and a real Redis: one call keeps many workers alive,
names the ones that must register again, and refuses bad input with an OpenAI-style error."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controller.batched_writes import MAX_BATCH as COALESCED_MAX
from controller.batched_writes import ROUTINE_GATHER_S, Coalescer, HeartbeatCoalescer
from controller.overload import LoopLag
from controller.registry_api import MAX_BATCH, REGISTRATION_RETRY_AFTER_S, RegistryApi
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerState
from poolgate.kernel.store import FleetChange, FleetStore, connect

CONFIG = parse_config({
    "pools": [{"name": "chat", "model": "m1"}],
    "controller": {"heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 0.6},
})
TOKEN = "batch-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def counted(answer: dict[str, object]) -> dict[str, object]:
    """A batch answer without the pace it hands out (``heartbeat_interval_s``, ``heartbeat_ttl_s``)."""
    return {name: answer[name] for name in ("ok", "not_registered")}


def registration(worker_id: str, port: int) -> dict[str, object]:
    """The body a worker of pool ``chat`` registers with."""
    return {"id": worker_id, "pool": "chat", "host": "127.0.0.1", "port": port}


async def register(http: aiohttp.ClientSession, base: str, worker_id: str, port: int) -> int:
    """One registration through the API; its status."""
    async with http.post(f"{base}/v1/workers", json=registration(worker_id, port)) as response:
        await response.read()
        return response.status


LONG_TTL = parse_config({"pools": [{"name": "chat", "model": "m1"}], "controller": {"heartbeat_ttl_s": 60}})


@contextlib.asynccontextmanager
async def serving(redis_url: str, prefix: str, lag: LoopLag | None = None) -> AsyncIterator[
        tuple[str, RegistryApi, FleetStore]]:
    """A registry API on a free port over its own small Redis pool (callers queue for its 4 connections)."""
    redis = connect(redis_url, max_connections=4, wait_s=5.0)
    store = FleetStore(redis, prefix)
    registry = RegistryApi(store, TOKEN, LONG_TTL.pools, LONG_TTL.controller, lag=lag)
    runner = web.AppRunner(registry.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", registry, store
    finally:
        await runner.cleanup()
        await redis.aclose()


@pytest.fixture()
async def api(redis_url: str) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    redis = connect(redis_url, max_connections=4, wait_s=5.0)  # a small pool: callers queue for it
    registry = RegistryApi(FleetStore(redis, "b"), TOKEN, CONFIG.pools, CONFIG.controller, CONFIG.autoscale.pools)
    runner = web.AppRunner(registry.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", redis
    await runner.cleanup()
    await redis.aclose()


async def test_one_batch_keeps_a_nodes_workers_alive(api: tuple[str, aioredis.Redis]) -> None:
    base, redis = api
    store = FleetStore(redis, "b")
    ids = [f"n1-w{i}" for i in range(6)]
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for i, worker_id in enumerate(ids):
            assert await register(http, base, worker_id, 9100 + i) == 201
        for _ in range(6):  # 1.2 s: twice the TTL, kept alive by batches alone
            beats = [{"id": worker_id} for worker_id in ids[1:]] + [{"id": "n1-gone"}]
            beats[0]["state"] = "Busy"
            async with http.post(f"{base}/v1/heartbeats", json={"workers": beats}) as response:
                assert response.status == 200
                assert counted(await response.json()) == {"ok": 5, "not_registered": ["n1-gone"]}
            await asyncio.sleep(0.2)
    states = {r.id: r.state for r in await store.read_fleet()}
    assert sorted(states) == ids[1:], "the worker left out of the batches should have expired"
    assert states["n1-w1"] is WorkerState.BUSY


@pytest.mark.parametrize("body", [{"workers": [{"id": "w1", "kv_usage": 2}]}, {"workers": [{"port": 1}]},
                                  {"workers": [{"id": "w1"}] * (MAX_BATCH + 1)}, {"nodes": []}])
async def test_bad_batch_is_a_400(api: tuple[str, aioredis.Redis], body: object) -> None:
    base, _ = api
    async with aiohttp.ClientSession(headers=AUTH) as http, http.post(f"{base}/v1/heartbeats", json=body) as r:
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "invalid_heartbeat"


async def test_many_callers_at_once_wait_for_the_pool_instead_of_failing(api: tuple[str, aioredis.Redis]) -> None:
    base, _ = api
    async with aiohttp.ClientSession(headers=AUTH) as http:
        # 64 callers at once over the registry's 4 Redis connections
        statuses = await asyncio.gather(*(register(http, base, f"c{i}", 9200 + i) for i in range(64)))
    assert statuses == [201] * 64


async def test_single_heartbeats_at_once_share_pipelines_and_each_gets_its_own_answer(redis_url: str) -> None:
    async with serving(redis_url, "c") as (base, registry, store):
        ids = [f"s-w{i}" for i in range(100)]
        async with aiohttp.ClientSession(headers=AUTH) as http:
            for i, worker_id in enumerate(ids):
                assert await register(http, base, worker_id, 9300 + i) == 201

            async def beat(worker_id: str, body: dict[str, str]) -> int:
                async with http.post(f"{base}/v1/workers/{worker_id}/heartbeat", json=body) as response:
                    await response.read()
                    return response.status

            bodies = [({"state": "Busy"} if worker_id == "s-w7" else {}) for worker_id in ids]
            statuses = await asyncio.gather(*(beat(w, b) for w, b in zip(ids, bodies, strict=True)),
                                            beat("s-gone", {}))
        assert statuses == [200] * 100 + [404]
        print(f"101 heartbeats at once went in {registry.heartbeats.batches} pipelines")
        assert registry.heartbeats.batches < 101
        states = {r.id: r.state for r in await store.read_fleet()}
        assert states["s-w7"] is WorkerState.BUSY and states["s-w8"] is WorkerState.READY


async def test_node_batches_at_once_share_pipelines_and_each_gets_its_own_answer(redis_url: str) -> None:
    async with serving(redis_url, "n") as (base, registry, store):
        nodes = [[f"n{n}-w{i}" for i in range(5)] for n in range(20)]
        async with aiohttp.ClientSession(headers=AUTH) as http:
            for n, node in enumerate(nodes):
                for i, worker_id in enumerate(node):
                    assert await register(http, base, worker_id, 9400 + 5 * n + i) == 201

            async def beat(beats: list[dict[str, str]]) -> object:
                async with http.post(f"{base}/v1/heartbeats", json={"workers": beats}) as response:
                    return await response.json()

            batches = [[{"id": worker_id} for worker_id in node] for node in nodes]
            batches[3].append({"id": "n0-w0", "state": "Busy"})  # a worker named by two nodes' batches
            batches[5].append({"id": "gone"})
            answers = await asyncio.gather(*(beat(b) for b in batches))
        assert counted(answers[3]) == {"ok": 6, "not_registered": []}
        assert counted(answers[5]) == {"ok": 5, "not_registered": ["gone"]}
        assert all(counted(a) == {"ok": 5, "not_registered": []} for i, a in enumerate(answers) if i not in (3, 5))
        print(f"20 node batches at once went in {registry.heartbeats.batches} pipelines")
        assert registry.heartbeats.batches < 20
        states = {r.id: r.state for r in await store.read_fleet()}
        assert states["n0-w0"] is WorkerState.BUSY and len(states) == 100


async def test_a_batch_longer_than_one_pipeline_is_answered_once_all_of_it_is_written() -> None:
    flushed: list[int] = []

    async def flush(values: dict[str, int]) -> dict[str, int]:
        flushed.append(len(values))
        return {key: value * 2 for key, value in values.items()}

    coalescer: Coalescer[int, int] = Coalescer(flush, lambda earlier, later: later)
    values = {f"k{i}": i for i in range(COALESCED_MAX + 10)}
    answers, single = await asyncio.gather(coalescer.submit_many(values), coalescer.submit("k3", 100))
    assert flushed == [COALESCED_MAX, 10]
    assert answers == {**{key: value * 2 for key, value in values.items()}, "k3": 200} and single == 200


GATHER_S = 0.2
"""A gathering time long enough that a late loop on a loaded host does not split what the tests gather."""


class _CountingStore:
    """A store that counts its heartbeat writes (one pipeline each)."""

    def __init__(self) -> None:
        self.written: list[dict[str, dict[str, Any]]] = []

    async def heartbeat_many(self, beats: dict[str, dict[str, Any]], ttl_s: float) -> list[str]:
        self.written.append(dict(beats))
        return [worker_id for worker_id in beats if worker_id.startswith("gone")]


async def test_heartbeats_that_arrive_one_by_one_share_a_pipeline() -> None:
    """Workers beat at their own phases, so routine heartbeats come one per turn of the loop: they wait a
    moment for each other, and a worker that is not registered is still told so."""
    store = _CountingStore()
    heartbeats = HeartbeatCoalescer(cast(FleetStore, store), gather_s=GATHER_S)
    beats = []
    for worker_id in ("w1", "w2", "gone", "w3"):
        beats.append(asyncio.create_task(heartbeats.beat(worker_id, {}, 1.5)))
        await asyncio.sleep(0.005)
    assert await asyncio.gather(*beats) == [True, True, False, True]
    assert store.written == [{"w1": {}, "w2": {}, "gone": {}, "w3": {}}]
    assert heartbeats.batches == 1
    state = await asyncio.wait_for(heartbeats.beat("w4", {"state": "Draining"}, 1.5), GATHER_S / 2)
    assert state and store.written[-1] == {"w4": {"state": "Draining"}}  # a state change does not wait


async def test_heartbeats_that_come_while_a_batch_is_in_redis_gather_too() -> None:
    store = _SlowRoutineStore()
    heartbeats = HeartbeatCoalescer(cast(FleetStore, store), gather_s=GATHER_S)
    first = asyncio.create_task(heartbeats.beat("w1", {}, 1.5))
    await asyncio.sleep(GATHER_S + 0.05)  # the first batch is in Redis and stays there
    later = [asyncio.create_task(heartbeats.beat(worker_id, {}, 1.5)) for worker_id in ("w2", "w3")]
    await asyncio.sleep(0)
    store.release.set()
    assert await first and all(await asyncio.gather(*later))
    assert store.written == [{"w1": {}}, {"w2": {}, "w3": {}}]


class _SlowRoutineStore:
    """A store whose routine heartbeats (no state) stay in flight until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.written: list[dict[str, dict[str, Any]]] = []

    async def heartbeat_many(self, beats: dict[str, dict[str, Any]], ttl_s: float) -> list[str]:
        if any("state" not in facts for facts in beats.values()):
            await self.release.wait()
        self.written.append(beats)
        return []


async def test_a_state_change_does_not_wait_for_the_routine_batch_in_flight() -> None:
    store = _SlowRoutineStore()
    heartbeats = HeartbeatCoalescer(cast(FleetStore, store))
    routine = asyncio.create_task(heartbeats.beat_many({"w1": {}, "w2": {"kv_usage": 0.5}}, 1.5))
    await asyncio.sleep(ROUTINE_GATHER_S + 0.02)  # the routine batch has left and stays in flight
    assert await asyncio.wait_for(heartbeats.beat("w3", {"state": "Draining"}, 1.5), 1)
    assert store.written == [{"w3": {"state": "Draining"}}]
    mixed = asyncio.create_task(heartbeats.beat_many({"w4": {"state": "Draining"}, "w5": {}}, 1.5))
    await asyncio.sleep(0.05)
    assert {"w4": {"state": "Draining"}} in store.written  # a node's state change leaves at once too
    assert not routine.done() and not mixed.done()  # the node's answer waits for its routine part
    ready = asyncio.create_task(heartbeats.beat("w6", {"state": "Ready"}, 1.5))
    await asyncio.sleep(0)  # one turn of the loop: on a busy API process each turn waits behind hundreds of calls
    assert {"w6": {"state": "Ready"}} in store.written and await ready  # written in its caller's first turn
    store.release.set()
    assert await routine == [] and await mixed == []
    assert {"w1": {}, "w2": {"kv_usage": 0.5}} in store.written and {"w5": {}} in store.written


async def test_a_burst_of_registrations_shares_pipelines_and_wakes_readers_once_per_batch(redis_url: str) -> None:
    async with serving(redis_url, "r") as (base, registry, store):
        async with store.changes() as feed, aiohttp.ClientSession(headers=AUTH) as http:
            statuses = await asyncio.gather(*(register(http, base, f"r-w{i}", 9400 + i) for i in range(100)),
                                            register(http, base, "r-w7", 9407))  # twice at once: written once
            announcements: list[FleetChange] = []
            for _ in range(5):  # the first read may take only the subscription's confirmation
                announcements += await feed.changes(timeout_s=0.2)
        assert statuses == [201] * 101
        print(f"101 registrations went in {registry.registrations.batches} pipelines, "
              f"{len(announcements)} announcements")
        assert registry.registrations.batches < 100 and len(announcements) == registry.registrations.batches
        assert sorted(r.id for r in await store.read_fleet()) == sorted(f"r-w{i}" for i in range(100))


async def test_a_registry_running_behind_puts_registrations_off_but_keeps_taking_heartbeats(redis_url: str) -> None:
    lag = LoopLag()
    async with serving(redis_url, "d", lag) as (base, registry, _):
        async with aiohttp.ClientSession(headers=AUTH) as http:
            assert await register(http, base, "d-early", 9500) == 201
            now = time.monotonic()
            for i in range(10):  # the loop has been 0.6 s behind for the last half second
                lag.record(now - 0.5 + i * 0.05, 0.6)
            async with http.post(f"{base}/v1/workers", json=registration("d-late", 9500)) as response:
                assert response.status == 503
                assert int(response.headers["Retry-After"]) >= REGISTRATION_RETRY_AFTER_S
                assert (await response.json())["error"]["code"] == "registry_busy"
            retry_after = []
            for i in range(400):  # a fleet registering at once is told to come back spread out
                async with http.post(f"{base}/v1/workers", json=registration(f"d-many-{i}", 9500)) as response:
                    assert response.status == 503
                    retry_after.append(int(response.headers["Retry-After"]))
            print(f"Retry-After over 400 put-off registrations: {min(retry_after)}-{max(retry_after)} s")
            assert min(retry_after) >= REGISTRATION_RETRY_AFTER_S and max(retry_after) >= 2
            async with http.post(f"{base}/v1/workers/d-early/heartbeat", json={}) as response:
                assert response.status == 200
            async with http.post(f"{base}/v1/heartbeats", json={"workers": [{"id": "d-early"}]}) as response:
                assert counted(await response.json()) == {"ok": 1, "not_registered": []}
            lag.record(now + 2.0, 0.0)  # caught up
            assert await register(http, base, "d-late", 9500) == 201
        assert registry.registrations_deferred == 401
