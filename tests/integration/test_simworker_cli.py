"""``poolgate simworker`` as a process: several workers on one loop, clean exit on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from email.message import Message

import pytest

from poolgate.kernel.routing import WORKER_HEADER
from poolgate.procs import free_port, port_open


def http(url: str, body: bytes | None = None) -> tuple[Message, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.headers, response.read()


def wait_ports(ports: list[int], proc: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(port_open("127.0.0.1", port) for port in ports):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"simworker did not listen on {ports}")
        time.sleep(0.05)


@pytest.fixture()
def stop_later() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def test_multi_port_process_serves_independent_workers(stop_later: list[subprocess.Popen[bytes]]) -> None:
    ports = [free_port(), free_port()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "simworker", "--ports", *map(str, ports),
         "--worker-ids", "alpha", "beta", "--preset", "l4-24gb", "--time-scale", "50", "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop_later.append(proc)
    wait_ports(ports, proc)
    answers = [http(f"http://127.0.0.1:{port}/v1/completions", b'{"prompt": "hi", "max_tokens": 3}')
               for port in ports]
    assert [headers[WORKER_HEADER] for headers, _ in answers] == ["alpha", "beta"]
    assert all(json.loads(body)["usage"]["completion_tokens"] == 3 for _, body in answers)
    generated = [
        next(line for line in http(f"http://127.0.0.1:{port}/metrics")[1].decode().splitlines()
             if line.startswith("vllm:generation_tokens_total"))
        for port in ports
    ]
    assert all(line.endswith(" 3.0") for line in generated)  # one registry per worker
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert not any(port_open("127.0.0.1", port) for port in ports)


def test_crash_of_the_only_worker_exits_the_process(stop_later: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(port), "--crash-at-s", "0.3",
         "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop_later.append(proc)
    assert proc.wait(15) == 1


def test_bad_flags_fail_fast(stop_later: list[subprocess.Popen[bytes]]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(free_port()), "--preset", "l4-24gb",
         "--num-gpu-blocks", "10"], capture_output=True, timeout=15, check=False)
    assert result.returncode == 2
    assert b"max_model_len" in result.stderr


def test_startup_delay_keeps_the_port_closed_like_a_model_load(stop_later: list[subprocess.Popen[bytes]]) -> None:
    """vLLM opens its port only once the engine is built: a controller probing /health sees connection
    refused until then. The delay is a lower bound (a loaded machine only adds to it)."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(port), "--startup-delay-s", "2",
         "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stop_later.append(proc)
    wait_ports([port], proc, timeout_s=30)
    opened = time.monotonic() - started
    print(f"\nmeasured: --startup-delay-s 2 opened the port {opened:.2f} s after the process started")
    assert opened >= 2.0
    http(f"http://127.0.0.1:{port}/health")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_sigterm_during_the_startup_delay_exits_at_once(stop_later: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "simworker", "--port", str(port), "--startup-delay-s", "120",
         "--log-level", "INFO"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stop_later.append(proc)
    assert proc.stdout is not None
    for line in proc.stdout:  # the worker says it is loading once its loop runs and the signal handler is set
        if b"loading its model" in line:
            break
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    proc.stdout.close()
    assert not port_open("127.0.0.1", port)
