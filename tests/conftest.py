"""Shared fixtures: a private redis-server on a free port (never the machine's 6379), and simulated workers
served in the test's event loop. At the session's end the stacks' run directories are removed when every test
passed, and named when one failed (their logs are what a failure is read from)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from bench.redis_deployments import RedisServer
from poolgate.procs import free_port
from simworker.presets import PRESETS
from simworker.worker import SimWorker, WorkerSpec
from tests import run_dirs

StartSimWorker = Callable[..., Awaitable[SimWorker]]
"""Starts one simulated worker; keywords are ``WorkerSpec`` fields."""


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


@pytest.fixture()
async def start_simworker() -> AsyncIterator[StartSimWorker]:
    """Simulated workers, each on a free port and listening when ``start`` returns: an H100 at 20× real speed
    with the id ``sim-PORT`` unless the keywords say otherwise. All are stopped after the test."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(**spec: Any) -> SimWorker:
        port = free_port()
        worker = SimWorker(WorkerSpec(**{"port": port, "worker_id": f"sim-{port}", "preset": PRESETS["h100-80gb"],
                                         "time_scale": 20.0, **spec}))
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(worker.serve(stop))))
        await asyncio.wait_for(worker.listening.wait(), 5)
        return worker

    yield start
    for stop, _ in running:
        stop.set()
    await asyncio.wait_for(asyncio.gather(*(task for _, task in running)), 10)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0:
        run_dirs.remove_all()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int) -> None:
    kept = run_dirs.made()
    if kept and exitstatus != 0:
        terminalreporter.write_line("run directories kept for their logs: " + " ".join(map(str, kept)))
