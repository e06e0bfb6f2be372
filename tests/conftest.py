"""Shared fixtures: a private redis-server on a free port (never the machine's 6379)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from bench.redis_deployments import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    redis_server.flush()
    return redis_server.url


@pytest.fixture()
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the tests' own Redis, emptied for this test; closed after it."""
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()
