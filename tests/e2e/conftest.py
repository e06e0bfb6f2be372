"""The whole stack, started the way users start it: ``poolgate up`` as a process, on free ports.

Redis is the tests' own redis-server; Envoy comes from the wheel; workers are simulated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import yaml

from poolgate.procs import free_port

E2E_CONFIG = {
    "key_prefix": "e2e",
    "controller": {"token": "e2e-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "extproc": {"max_request_bytes": 1048576},
    "pools": [
        {"name": "chat", "model": "chat-model", "max_model_len": 8192},
        {"name": "code", "model": "code-model", "max_model_len": 4096},
    ],
    "workers": [
        {"id": "chat-a", "pool": "chat"},
        {"id": "chat-b", "pool": "chat"},
        {"id": "code-a", "pool": "code", "preset": "l4-24gb"},
        {"id": "code-b", "pool": "code", "preset": "l4-24gb"},
    ],
}


@dataclass
class RunningStack:
    base_url: str
    admin_url: str
    redis_url: str
    run_dir: Path
    config: dict[str, object]
    process: subprocess.Popen[str]

    def children(self) -> dict[str, int]:
        return {k: int(v) for k, v in json.loads((self.run_dir / "children.json").read_text()).items()}

    def worker_address(self, worker_id: str) -> str:
        client = redis.Redis.from_url(self.redis_url)
        try:
            data = client.hgetall(f"{self.config['key_prefix']}:worker:{worker_id}")
        finally:
            client.close()
        return f"{data[b'host'].decode()}:{data[b'port'].decode()}"

    def controller_url(self) -> str:
        for line in (self.run_dir / "controller.log").read_text().splitlines():
            if "controller ready: api " in line:
                return line.split("controller ready: api ")[1].split()[0]
        raise AssertionError("controller did not print its API address")


@pytest.fixture(scope="session")
def stack(redis_server: object) -> Iterator[RunningStack]:
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-e2e-"))
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(E2E_CONFIG))
    port, admin = free_port(), free_port()
    redis_url = redis_server.url  # type: ignore[attr-defined]
    process = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "up", "--config", str(config_path), "--port", str(port),
         "--admin-port", str(admin), "--redis-url", redis_url, "--log-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 120
    output = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        output.append(line)
        if line.startswith("READY "):
            break
    if not output or not output[-1].startswith("READY "):
        process.kill()
        raise AssertionError("poolgate up did not become ready:\n" + "".join(output))
    running = RunningStack(f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{admin}", redis_url, run_dir,
                           E2E_CONFIG, process)
    # Keep reading its output so a chatty child can never block on a full pipe.
    drain = threading.Thread(target=lambda: [output.append(line) for line in process.stdout or []], daemon=True)
    drain.start()
    yield running
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    drain.join(5)
    if process.stdout:
        process.stdout.close()
    leftovers = [name for name, pid in running.children().items() if pid_alive(pid)]
    assert not leftovers, f"processes left behind: {leftovers}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
