"""Registry API over real HTTP and a real Redis: token required, entries expire without heartbeats."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controller.api_processes import Forwarder
from controller.lean_front import LeanFront
from controller.registry_api import RegistryApi
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerState
from poolgate.kernel.store import FleetStore

CONFIG = parse_config({
    "pools": [{"name": "chat", "model": "m1", "max_model_len": 4096}],
    "controller": {"heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 0.6},
})
TOKEN = "s3cret-token"


@pytest.fixture(params=["aiohttp", "lean front"])
async def api(redis_url: str, request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, aioredis.Redis]]:
    """The controller's aiohttp routes, or an API process's lean front over the same registry (passing every call
    that is not a worker's on to those routes, as it does to the controller's): each test holds for both."""
    redis = aioredis.from_url(redis_url)
    registry = RegistryApi(FleetStore(redis, "t"), TOKEN, CONFIG.pools, CONFIG.controller, CONFIG.autoscale.pools)
    runner = web.AppRunner(registry.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    forwarder = Forwarder(base)
    front = await asyncio.get_running_loop().create_server(lambda: LeanFront(registry, forwarder), "127.0.0.1", 0)
    if request.param == "lean front":
        base = f"http://127.0.0.1:{front.sockets[0].getsockname()[1]}"
    yield base, redis
    front.close()
    await forwarder.close()
    await runner.cleanup()
    await redis.aclose()


AUTH = {"Authorization": f"Bearer {TOKEN}"}
WORKER = {"id": "w1", "pool": "chat", "host": "127.0.0.1", "port": 9001}


async def test_register_requires_the_token(api: tuple[str, aioredis.Redis]) -> None:
    base, redis = api
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            async with http.post(f"{base}/v1/workers", json=WORKER, headers=headers) as response:
                assert response.status == 401
                assert (await response.json())["error"]["code"] == "unauthorized"
    assert await FleetStore(redis, "t").read_fleet() == []


async def test_register_heartbeat_expire_and_deregister(api: tuple[str, aioredis.Redis]) -> None:
    base, redis = api
    store = FleetStore(redis, "t")
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{base}/v1/workers", json=WORKER) as response:
            assert response.status == 201
        [record] = await store.read_fleet()
        assert (record.model, record.max_model_len, record.state) == ("m1", 4096, WorkerState.READY)
        # Heartbeats keep it alive well past the TTL and update live facts.
        for _ in range(5):
            async with http.post(f"{base}/v1/workers/w1/heartbeat", json={"kv_usage": 0.5, "running": 3}) as r:
                assert r.status == 200
            await asyncio.sleep(0.2)
        [record] = await store.read_fleet()
        assert (record.kv_usage, record.running) == (0.5, 3)
        # Without heartbeats it expires and a late heartbeat is told to register again.
        await asyncio.sleep(0.9)
        assert await store.read_fleet() == []
        async with http.post(f"{base}/v1/workers/w1/heartbeat", json={}) as response:
            assert response.status == 404
        async with http.post(f"{base}/v1/workers", json=WORKER) as response:
            assert response.status == 201
        async with http.delete(f"{base}/v1/workers/w1") as response:
            assert response.status == 204
        assert await store.read_fleet() == []


async def test_a_bad_fact_is_refused_and_a_null_one_left_out(api: tuple[str, aioredis.Redis]) -> None:
    base, redis = api
    store = FleetStore(redis, "t")
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{base}/v1/workers", json=WORKER) as response:
            assert response.status == 201
        for bad in ({"kv_usage": 2}, {"running": -1}, {"colour": "red"}, [1]):
            async with http.post(f"{base}/v1/workers/w1/heartbeat", json=bad) as response:
                assert response.status == 400, bad
                assert (await response.json())["error"]["code"] == "invalid_heartbeat"
        async with http.post(f"{base}/v1/workers/w1/heartbeat", json={"kv_usage": 0.25, "running": 2}) as r:
            assert r.status == 200
        body = {"workers": [{"id": "w1", "kv_usage": None, "running": 4, "state": "Busy"}]}
        async with http.post(f"{base}/v1/heartbeats", json=body) as response:
            assert response.status == 200
    [record] = await store.read_fleet()
    assert (record.kv_usage, record.running, record.state) == (0.25, 4, WorkerState.BUSY)


@pytest.mark.parametrize(
    "body",
    [
        {**WORKER, "pool": "nope"},
        {**WORKER, "port": 0},
        {**WORKER, "id": "bad id!"},
        {"pool": "chat"},
        {**WORKER, "surprise": 1},
        {**WORKER, "node": "gpu node 1"},
        {**WORKER, "node": ""},
        {**WORKER, "node": "-gpu-1"},
        {**WORKER, "node": "n" * 254},
    ],
)
async def test_bad_registrations_are_refused(api: tuple[str, aioredis.Redis], body: dict[str, object]) -> None:
    base, redis = api
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{base}/v1/workers", json=body) as response:
            assert response.status == 400
            assert "error" in await response.json()
        async with http.post(f"{base}/v1/workers", data=b"{not json") as response:
            assert response.status == 400
    assert await FleetStore(redis, "t").read_fleet() == []


async def test_the_node_a_worker_runs_on_is_recorded(api: tuple[str, aioredis.Redis]) -> None:
    base, redis = api
    store = FleetStore(redis, "t")
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(f"{base}/v1/workers", json={**WORKER, "node": "gpu-node-7.example"}) as response:
            assert response.status == 201
            assert (await response.json())["node"] == "gpu-node-7.example"
        async with http.post(f"{base}/v1/workers", json={**WORKER, "id": "w2"}) as response:
            assert response.status == 201
    assert {w.id: w.node for w in await store.read_fleet()} == {"w1": "gpu-node-7.example", "w2": ""}
