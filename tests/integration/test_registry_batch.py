"""The node agent's batch heartbeat over real HTTP and a real Redis: one call keeps many workers alive,
names the ones that must register again, and refuses bad input with an OpenAI-style error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

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
            body = {"id": worker_id, "pool": "chat", "host": "127.0.0.1", "port": 9100 + i}
            async with http.post(f"{base}/v1/workers", json=body) as response:
                assert response.status == 201
        for _ in range(6):  # 1.2 s: twice the TTL, kept alive by batches alone
            beats = [{"id": worker_id} for worker_id in ids[1:]] + [{"id": "n1-gone"}]
            beats[0]["state"] = "Busy"
            async with http.post(f"{base}/v1/heartbeats", json={"workers": beats}) as response:
                assert response.status == 200
                assert await response.json() == {"ok": 5, "not_registered": ["n1-gone"]}
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
        async def register(i: int) -> int:
            body = {"id": f"c{i}", "pool": "chat", "host": "127.0.0.1", "port": 9200 + i}
            async with http.post(f"{base}/v1/workers", json=body) as response:
                return response.status

        statuses = await asyncio.gather(*(register(i) for i in range(64)))  # 64 callers, 4 connections
    assert statuses == [201] * 64


async def test_single_heartbeats_at_once_share_pipelines_and_each_gets_its_own_answer(redis_url: str) -> None:
    config = parse_config({"pools": [{"name": "chat", "model": "m1"}], "controller": {"heartbeat_ttl_s": 60}})
    redis = connect(redis_url, max_connections=4, wait_s=5.0)
    store = FleetStore(redis, "c")
    registry = RegistryApi(store, TOKEN, config.pools, config.controller)
    runner = web.AppRunner(registry.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        ids = [f"s-w{i}" for i in range(100)]
        async with aiohttp.ClientSession(headers=AUTH) as http:
            for i, worker_id in enumerate(ids):
                body = {"id": worker_id, "pool": "chat", "host": "127.0.0.1", "port": 9300 + i}
                async with http.post(f"{base}/v1/workers", json=body) as response:
                    assert response.status == 201

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
    finally:
        await runner.cleanup()
        await redis.aclose()


async def test_a_burst_of_registrations_shares_pipelines_and_wakes_readers_once_per_batch(redis_url: str) -> None:
    config = parse_config({"pools": [{"name": "chat", "model": "m1"}], "controller": {"heartbeat_ttl_s": 60}})
    redis = connect(redis_url, max_connections=4, wait_s=5.0)
    store = FleetStore(redis, "r")
    registry = RegistryApi(store, TOKEN, config.pools, config.controller)
    runner = web.AppRunner(registry.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with store.changes() as feed, aiohttp.ClientSession(headers=AUTH) as http:
            async def register(i: int) -> int:
                body = {"id": f"r-w{i}", "pool": "chat", "host": "127.0.0.1", "port": 9400 + i}
                async with http.post(f"{base}/v1/workers", json=body) as response:
                    await response.read()
                    return response.status

            statuses = await asyncio.gather(*(register(i) for i in range(100)),
                                            register(7))  # the same worker twice at once: written once
            announcements: list[FleetChange] = []
            for _ in range(5):  # the first read may take only the subscription's confirmation
                announcements += await feed.changes(timeout_s=0.2)
        assert statuses == [201] * 101
        print(f"101 registrations went in {registry.registrations.batches} pipelines, "
              f"{len(announcements)} announcements")
        assert registry.registrations.batches < 100 and len(announcements) == registry.registrations.batches
        assert sorted(r.id for r in await store.read_fleet()) == sorted(f"r-w{i}" for i in range(100))
    finally:
        await runner.cleanup()
        await redis.aclose()


async def test_a_registry_running_behind_puts_registrations_off_but_keeps_taking_heartbeats(redis_url: str) -> None:
    config = parse_config({"pools": [{"name": "chat", "model": "m1"}], "controller": {"heartbeat_ttl_s": 60}})
    redis = connect(redis_url, max_connections=4, wait_s=5.0)
    lag = LoopLag()
    registry = RegistryApi(FleetStore(redis, "d"), TOKEN, config.pools, config.controller, lag=lag)
    runner = web.AppRunner(registry.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession(headers=AUTH) as http:
            def body(worker_id: str) -> dict[str, object]:
                return {"id": worker_id, "pool": "chat", "host": "127.0.0.1", "port": 9500}

            async with http.post(f"{base}/v1/workers", json=body("d-early")) as response:
                assert response.status == 201
            now = time.monotonic()
            for i in range(10):  # the loop has been 0.6 s behind for the last half second
                lag.record(now - 0.5 + i * 0.05, 0.6)
            async with http.post(f"{base}/v1/workers", json=body("d-late")) as response:
                assert response.status == 503
                assert int(response.headers["Retry-After"]) >= REGISTRATION_RETRY_AFTER_S
                assert (await response.json())["error"]["code"] == "registry_busy"
            retry_after = []
            for i in range(400):  # a fleet registering at once is told to come back spread out
                async with http.post(f"{base}/v1/workers", json=body(f"d-many-{i}")) as response:
                    assert response.status == 503
                    retry_after.append(int(response.headers["Retry-After"]))
            print(f"Retry-After over 400 put-off registrations: {min(retry_after)}-{max(retry_after)} s")
            assert min(retry_after) >= REGISTRATION_RETRY_AFTER_S and max(retry_after) >= 2
            async with http.post(f"{base}/v1/workers/d-early/heartbeat", json={}) as response:
                assert response.status == 200
            async with http.post(f"{base}/v1/heartbeats", json={"workers": [{"id": "d-early"}]}) as response:
                assert await response.json() == {"ok": 1, "not_registered": []}
            lag.record(now + 2.0, 0.0)  # caught up
            async with http.post(f"{base}/v1/workers", json=body("d-late")) as response:
                assert response.status == 201
        assert registry.registrations_deferred == 401
    finally:
        await runner.cleanup()
        await redis.aclose()
