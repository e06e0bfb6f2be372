"""Shared fixtures: a private redis-server on a free port (never the machine's 6379), and simulated workers
served in the test's event loop."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from poolgate.procs import free_port, stop_process
from simworker.presets import PRESETS
from simworker.worker import SimWorker, WorkerSpec

StartSimWorker = Callable[..., Awaitable[SimWorker]]
"""Starts one simulated worker; keywords are ``WorkerSpec`` fields."""


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="poolgate-redis-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def flush(self) -> None:
        client = redis.Redis(port=self.port)
        client.flushall()
        client.close()

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


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
