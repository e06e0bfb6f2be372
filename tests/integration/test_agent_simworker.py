"""The agent against a real simulated worker process and a real Redis, in-process and as ``poolgate agent``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from agent.agent import run_agent
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port, simworker_process

MODEL = "m"
WORKER_ID = "agent-sim"
KEYS = RedisKeys("agent-it")
CONFIG = parse_config({
    "pools": [{"name": "chat", "model": MODEL}],
    "key_prefix": KEYS.prefix,
    "controller": {"heartbeat_interval_s": 1.0, "heartbeat_ttl_s": 10.0},
    "agent": {"scrape_interval_s": 0.1, "nvml": "off"},
})


@pytest.fixture(scope="module")
def simworker() -> Iterator[int]:
    port = free_port()
    with simworker_process([port], ["--worker-ids", WORKER_ID, "--model", MODEL, "--preset", "l4-24gb",
                                    "--time-scale", "5", "--log-level", "WARNING"], start_timeout_s=15):
        yield port


@pytest.fixture()
async def redis(redis_url: str, simworker: int) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    record = WorkerRecord(id=WORKER_ID, pool="chat", model=MODEL, host="127.0.0.1", port=simworker)
    await FleetStore(client, KEYS.prefix).register(record, ttl_s=10.0)
    yield client
    await client.aclose()


async def record_of(redis: aioredis.Redis) -> WorkerRecord:
    [record] = await FleetStore(redis, KEYS.prefix).read_fleet()
    return record


async def wait_for(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def complete(session: aiohttp.ClientSession, port: int, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": "route this request please " * 40, "max_tokens": max_tokens, "ignore_eos": True}
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
        assert response.status == 200
        await response.read()


async def test_agent_reports_a_simulated_worker(redis: aioredis.Redis, simworker: int) -> None:
    stop = asyncio.Event()
    agent = asyncio.create_task(run_agent(CONFIG, FleetStore(redis, KEYS.prefix), stop))
    try:
        async def reported() -> bool:
            return (await record_of(redis)).kv_capacity_tokens > 0

        await wait_for(reported)
        idle = await record_of(redis)
        assert idle.kv_block_size == 16 and idle.kv_capacity_tokens % 16 == 0
        assert 0.0 <= idle.kv_usage <= 1.0
        assert 20000 < idle.gpu_memory_total_mib < 25000  # the simulated 24 GB card, in MiB
        assert 0 <= idle.gpu_memory_free_mib < idle.gpu_memory_total_mib  # the weights are loaded

        async with aiohttp.ClientSession() as session:
            requests = asyncio.gather(*(complete(session, simworker, max_tokens=100) for _ in range(6)))

            async def busy() -> bool:
                record = await record_of(redis)
                return record.running > 0 and record.kv_usage > 0

            await wait_for(busy)
            await requests

        async def settled() -> bool:
            record = await record_of(redis)
            return record.running == 0 and record.ttft_ewma_s > 0 and record.prefill_tokens_per_s > 0

        await wait_for(settled)
        after = await record_of(redis)
        assert after.metrics_at > idle.metrics_at
        assert after.waiting == 0 and after.kv_usage == 0.0
    finally:
        stop.set()
        stats = await asyncio.wait_for(agent, 5)
    assert stats.scrape_failures == 0 and stats.writes > 5
    assert stats.announcements < stats.writes


async def run_cli_until_reported(redis: aioredis.Redis, config: Path, redis_url: str, args: list[str],
                                 env: dict[str, str] | None = None) -> str:
    """Start ``poolgate agent``, wait until it has written the worker's facts, stop it with SIGTERM (it must
    exit 0); returns its ready line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "poolgate.cli", "agent", "--config", str(config), "--redis-url", redis_url,
        *args, "--log-level", "WARNING", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()

        async def reported() -> bool:
            return (await record_of(redis)).kv_capacity_tokens > 0

        await wait_for(reported)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 5) == 0
        return line
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_runs_until_sigterm(redis: aioredis.Redis, redis_url: str, tmp_path: Path) -> None:
    config = tmp_path / "poolgate.yaml"
    config.write_text(f"key_prefix: {KEYS.prefix}\npools: [{{name: chat, model: {MODEL}}}]\n"
                      "controller: {heartbeat_interval_s: 1.0, heartbeat_ttl_s: 10.0}\n"
                      "agent: {scrape_interval_s: 0.1, nvml: 'off'}\n")
    line = await run_cli_until_reported(redis, config, redis_url, ["--workers", WORKER_ID])
    assert line.startswith("poolgate agent ready")


async def test_cli_takes_its_node_from_the_environment(redis: aioredis.Redis, redis_url: str, simworker: int,
                                                       tmp_path: Path) -> None:
    """As in the DaemonSet: POOLGATE_NODE_NAME comes from the Downward API, and the agent serves the workers
    registered on that node."""
    record = WorkerRecord(id=WORKER_ID, pool="chat", model=MODEL, host="127.0.0.1", port=simworker, node="gpu-a")
    await FleetStore(redis, KEYS.prefix).register(record, ttl_s=10.0)
    config = tmp_path / "poolgate.yaml"
    config.write_text(f"key_prefix: {KEYS.prefix}\npools: [{{name: chat, model: {MODEL}}}]\n"
                      "agent: {scrape_interval_s: 0.1, nvml: 'off'}\n")
    line = await run_cli_until_reported(
        redis, config, redis_url, ["--pod-resources-socket", str(tmp_path / "no-kubelet.sock")],
        env={**os.environ, "POOLGATE_NODE_NAME": "gpu-a"})
    assert line.startswith("poolgate agent ready: scraping workers on node gpu-a")


def test_cli_without_redis_fails_fast(tmp_path: Path) -> None:
    config = tmp_path / "poolgate.yaml"
    config.write_text(f"pools: [{{name: chat, model: {MODEL}}}]\n")
    result = subprocess.run([sys.executable, "-m", "poolgate.cli", "agent", "--config", str(config)],
                            capture_output=True, timeout=15, check=False)
    assert result.returncode == 2
    assert b"--redis-url" in result.stderr
    closed = subprocess.run([sys.executable, "-m", "poolgate.cli", "agent", "--config", str(config),
                             "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
                            capture_output=True, timeout=15, check=False)
    assert closed.returncode == 1
    assert b"cannot reach Redis" in closed.stderr
