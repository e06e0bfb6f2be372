"""The registration API is the door to Envoy's endpoints: no token, no entry; and even with the token, an
address outside ``controller.allowed_networks`` never becomes an endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from controller.registry_api import RegistryApi
from poolgate.kernel.config import Config, ConfigError, parse_config
from poolgate.kernel.store import FleetStore

TOKEN = "registry-security-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POOLS = [{"name": "chat", "model": "m1"}]
DEFAULT = parse_config({"pools": POOLS})
NARROW = parse_config({"pools": POOLS, "controller": {"allowed_networks": ["10.20.0.0/16", "fd12::/16"]}})


@pytest.fixture()
async def serve(redis_url: str) -> AsyncIterator[Callable[[Config], object]]:
    runners: list[web.AppRunner] = []
    redis = aioredis.from_url(redis_url)

    async def start(config: Config) -> str:
        runner = web.AppRunner(RegistryApi(FleetStore(redis, "sec"), TOKEN, config.pools, config.controller).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()
    await redis.aclose()


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/workers", None),
    ("POST", "/v1/workers", {"id": "w1", "pool": "chat", "host": "127.0.0.1", "port": 9001}),
    ("POST", "/v1/workers/w1/heartbeat", {}),
    ("DELETE", "/v1/workers/w1", None),
    ("POST", "/v1/workers/w1/drain", None),
    ("POST", "/v1/pools/chat/scale", {"workers": 2}),
])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                                     {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}])
async def test_every_registry_call_needs_the_token(serve: Callable[[Config], object], method: str, path: str,
                                                   body: object, headers: dict[str, str], redis_url: str) -> None:
    base = await serve(DEFAULT)  # type: ignore[misc]
    async with aiohttp.ClientSession() as http, http.request(method, f"{base}{path}", json=body,
                                                             headers=headers) as response:
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "unauthorized"
    redis = aioredis.from_url(redis_url)
    assert await FleetStore(redis, "sec").read_fleet() == []
    await redis.aclose()


@pytest.mark.parametrize("config, host, allowed", [
    (DEFAULT, "127.0.0.1", True),
    (DEFAULT, "10.1.2.3", True),
    (DEFAULT, "172.31.255.1", True),
    (DEFAULT, "192.168.7.7", True),
    (DEFAULT, "::1", True),
    (DEFAULT, "fd00::17", True),
    (DEFAULT, "169.254.169.254", False),  # cloud metadata service
    (DEFAULT, "::ffff:169.254.169.254", False),  # the same, IPv4-mapped
    (DEFAULT, "8.8.8.8", False),
    (DEFAULT, "172.32.0.1", False),  # just outside 172.16.0.0/12
    (DEFAULT, "0.0.0.0", False),
    (DEFAULT, "2001:4860:4860::8888", False),
    (DEFAULT, "example.com", False),  # names are refused: they could resolve anywhere later
    (DEFAULT, "localhost", False),
    (DEFAULT, "127.0.0.1 ", False),
    (NARROW, "10.20.3.4", True),
    (NARROW, "fd12::1", True),
    (NARROW, "127.0.0.1", False),
    (NARROW, "10.21.0.1", False),
])
async def test_registered_address_must_be_inside_allowed_networks(serve: Callable[[Config], object], config: Config,
                                                                  host: str, allowed: bool, redis_url: str) -> None:
    base = await serve(config)  # type: ignore[misc]
    body = {"id": "w1", "pool": "chat", "host": host, "port": 9001}
    async with aiohttp.ClientSession(headers=AUTH) as http, http.post(f"{base}/v1/workers", json=body) as response:
        answer = await response.json()
        assert response.status == (201 if allowed else 403), answer
    redis = aioredis.from_url(redis_url)
    workers = await FleetStore(redis, "sec").read_fleet()
    await redis.aclose()
    assert [w.host for w in workers] == ([host] if allowed else [])
    if not allowed:
        assert answer["error"]["code"] == "address_not_allowed"


@pytest.mark.parametrize("networks", [["10.0.0.1/8"], ["not-a-network"], ["300.0.0.0/8"]])
def test_bad_allowed_networks_fail_at_load_naming_the_field(networks: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"controller\.allowed_networks"):
        parse_config({"pools": POOLS, "controller": {"allowed_networks": networks}})
