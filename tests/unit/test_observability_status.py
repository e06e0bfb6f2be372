"""``poolgate status --watch``: redraws on its interval, survives a Redis outage, stops cleanly on Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest
import redis.asyncio as aioredis

from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.store import FleetStore
from poolgate.status import format_pools, watch


def test_pool_summary() -> None:
    workers = [WorkerRecord(id="a", pool="chat", model="m", host="10.0.0.1", port=1, kv_usage=0.5, running=2),
               WorkerRecord(id="b", pool="chat", model="m", host="10.0.0.2", port=1, kv_usage=0.1,
                            state=WorkerState.FAILED, waiting=3)]
    assert format_pools(workers, {"a": 4}) == (
        "pool chat: 1/2 serving, in-flight 4, running 2, waiting 3, mean kv 50%")


async def test_watch_redraws_until_stopped_and_reports_outages() -> None:
    stop = asyncio.Event()
    frames: list[str] = []
    calls = 0

    async def read() -> str:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise aioredis.ConnectionError("refused")
        if calls == 3:
            stop.set()
        return f"table {calls}"

    count = await watch(read, 0.01, frames.append, stop, clear=True, source="redis://x")
    assert count == 3
    assert frames[0].startswith("\x1b[H\x1b[2Jpoolgate fleet at ") and "table 1" in frames[0]
    assert "cannot reach Redis at redis://x: refused (retrying)" in frames[1]
    assert "table 3" in frames[2]


@pytest.mark.parametrize("interval", ["0", "abc"])
def test_interval_is_validated(interval: str) -> None:
    result = subprocess.run([sys.executable, "-m", "poolgate.cli", "status", "--watch", "--interval", interval],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "--interval" in result.stderr


async def _register(redis_url: str) -> None:
    redis = aioredis.from_url(redis_url)
    await FleetStore(redis, "poolgate").register(WorkerRecord(
        id="chat-1", pool="chat", model="llama", host="127.0.0.1", port=9000, kv_usage=0.25), ttl_s=30)
    await redis.aclose()


def test_watch_command_shows_the_fleet_and_exits_cleanly_on_ctrl_c(redis_url: str) -> None:
    asyncio.run(_register(redis_url))
    proc = subprocess.Popen([sys.executable, "-m", "poolgate.cli", "status", "--watch", "--interval", "0.2",
                             "--redis-url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert time.monotonic() - started < 2
    assert err == ""  # no traceback on Ctrl-C
    assert out.count("poolgate fleet at") >= 2
    assert "pool chat: 1/1 serving" in out and "chat-1" in out
    assert "\x1b[2J" not in out  # not a terminal: no screen clearing in the captured output
