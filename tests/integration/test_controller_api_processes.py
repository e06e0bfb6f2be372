"""``controller.api_processes``: a real controller process with two API processes on its port.

Workers' calls are answered whichever API process the kernel hands a connection to, and the controller itself
answers none of them (all still are while it is frozen); the operator's calls reach the controller through
any of them, an API process that dies is started again, and none outlives the controller."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from poolgate.procs import free_port, port_open

TOKEN = "api-processes-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SERVING = "serving on"
"""What an API process logs once it listens."""
CONFIG = {"key_prefix": "apiproc", "pools": [{"name": "chat", "model": "m1"}],
          "controller": {"token": TOKEN, "api_processes": 2, "heartbeat_ttl_s": 60}}


def api_children(pid: int) -> set[int]:
    """The controller's API processes."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {int(child) for child in children
            if b"controller.api_processes" in Path(f"/proc/{child}/cmdline").read_bytes()}


def wait_for(predicate: object, timeout_s: float = 30.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():  # type: ignore[operator]
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s")


@pytest.fixture()
def controller(redis_url: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """The controller, its API URL and its log (its API processes log there too), once all three serve."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    port = free_port()
    log = tmp_path / "controller.log"
    output = log.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "controller", "--config", str(config), "--redis-url", redis_url,
         "--xds-port", str(free_port()), "--http-port", str(port), "--no-workers",
         "--log-dir", str(tmp_path / "workers")],
        stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: port_open("127.0.0.1", port) and log.read_text().count(SERVING) == 2)
        yield process, f"http://127.0.0.1:{port}", log
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)
        output.close()
        print(log.read_text()[-3000:])


@pytest.fixture()
async def fresh_connections() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per call, so that the kernel spreads the calls over the processes."""
    async with aiohttp.ClientSession(headers=AUTH, connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=3)) as http:
        yield http


async def status_of(http: aiohttp.ClientSession, method: str, url: str, **kwargs: object) -> tuple[int, bytes]:
    try:
        async with http.request(method, url, **kwargs) as answer:  # type: ignore[arg-type]
            return answer.status, await answer.read()
    except TimeoutError:
        return 0, b""


async def test_every_process_answers_workers_and_passes_operator_calls_on(
        controller: tuple[subprocess.Popen[bytes], str, Path], fresh_connections: aiohttp.ClientSession) -> None:
    process, base, _ = controller
    http = fresh_connections
    registrations = [{"id": f"w{i}", "pool": "chat", "host": "127.0.0.1", "port": 9000 + i} for i in range(30)]
    answers = await asyncio.gather(*(status_of(http, "POST", f"{base}/v1/workers", json=r) for r in registrations))
    assert [status for status, _ in answers] == [201] * 30
    beats = await asyncio.gather(*(status_of(http, "POST", f"{base}/v1/heartbeats",
                                             json={"workers": [{"id": f"w{i}"}, {"id": "gone"}]}) for i in range(30)))
    assert all(status == 200 and b'"not_registered":["gone"]' in body for status, body in beats)
    status, body = await status_of(http, "GET", f"{base}/v1/workers")
    assert status == 200 and body.count(b'"pool":"chat"') == 30

    # Operator calls need the controller's instance controller: from any process the same answer (an API
    # process answering them itself would say 501, "this controller does not manage instances").
    drains = await asyncio.gather(*(status_of(http, "POST", f"{base}/v1/workers/nobody/drain") for _ in range(20)))
    assert {status for status, _ in drains} == {404}
    scales = await asyncio.gather(*(status_of(http, "POST", f"{base}/v1/pools/chat/scale", json={"workers": 2})
                                    for _ in range(20)))
    assert all(status == 400 and b"not_scalable" in body for status, body in scales)

    # Frozen, the controller answers nothing; workers do not need it: every heartbeat is answered.
    process.send_signal(signal.SIGSTOP)
    try:
        frozen = await asyncio.gather(*(status_of(http, "POST", f"{base}/v1/workers/w{i}/heartbeat", json={})
                                        for i in range(30)))
    finally:
        process.send_signal(signal.SIGCONT)
    answered = sum(1 for status, _ in frozen if status == 200)
    print(f"with the controller frozen, {answered} of 30 heartbeats were answered by the API processes")
    assert answered == 30


async def test_a_dead_api_process_is_started_again_and_none_outlives_the_controller(
        controller: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    process, _, log = controller
    before = api_children(process.pid)
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    took = wait_for(lambda: len(api_children(process.pid)) == 2 and victim not in api_children(process.pid)
                    and log.read_text().count(SERVING) == 3)
    print(f"the killed API process was replaced in {took:.2f} s")
    survivors = api_children(process.pid)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in survivors), timeout_s=10)


def test_api_processes_stop_when_their_controller_is_killed(
        controller: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    process, _, _ = controller
    children = api_children(process.pid)
    process.kill()  # no chance to stop them itself
    process.wait(10)
    took = wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), timeout_s=15)
    print(f"the API processes of a killed controller stopped within {took:.2f} s")
