"""The whole stack, started the way users start it: ``poolgate up`` as a process, on free ports.

Redis is the tests' own redis-server; Envoy comes from the wheel; workers are simulated.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml

from poolgate.kernel.keys import RedisKeys
from poolgate.procs import free_port, stop_process
from tests.run_dirs import run_directory

E2E_CONFIG: dict[str, Any] = {
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
    config_path: Path
    config: dict[str, Any]
    process: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return str(self.config.get("key_prefix", "poolgate"))

    def children(self) -> dict[str, int]:
        return {k: int(v) for k, v in json.loads((self.run_dir / "children.json").read_text()).items()}

    def extproc_metrics(self) -> str:
        """The Prometheus pages of every extproc process ``poolgate up`` started (``extproc.json`` in its run
        directory lists their ports), one after the other: summing a series over them counts all requests."""
        listed = json.loads((self.run_dir / "extproc.json").read_text())
        return "".join(httpx.get(f"http://127.0.0.1:{p['metrics_port']}/metrics", timeout=5).text
                       for p in listed.values())

    def record(self, worker_id: str) -> dict[str, str]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            raw = client.hgetall(RedisKeys(self.prefix).worker(worker_id))
        finally:
            client.close()
        return {k.decode(): v.decode() for k, v in raw.items()}

    def state(self, worker_id: str) -> str | None:
        return self.record(worker_id).get("state")

    def address(self, worker_id: str) -> str:
        record = self.record(worker_id)
        return f"{record['host']}:{record['port']}"

    def pool_ids(self, pool: str) -> list[str]:
        client = redis.Redis.from_url(self.redis_url)
        try:
            ids = sorted(i.decode() for i in client.smembers(RedisKeys(self.prefix).workers))
        finally:
            client.close()
        return [i for i in ids if self.record(i).get("pool") == pool]

    def envoy_hosts(self, cluster: str) -> dict[str, list[str]]:
        """address → health flags of a cluster's hosts, from Envoy's admin ``/clusters``."""
        text = httpx.get(f"{self.admin_url}/clusters", timeout=5).text
        hosts: dict[str, list[str]] = {}
        for line in text.splitlines():
            parts = line.split("::")
            if len(parts) >= 4 and parts[0] == cluster and parts[2] == "health_flags":
                hosts[parts[1]] = parts[3].split("|")
        return hosts

    def in_rotation(self, address: str, cluster: str = "pool-chat") -> bool:
        return self.envoy_hosts(cluster).get(address) == ["healthy"]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``poolgate ARGS`` against this stack (its config and Redis)."""
        return subprocess.run(
            [sys.executable, "-m", "poolgate.cli", *args, "--config", str(self.config_path), "--redis-url",
             self.redis_url], capture_output=True, text=True, timeout=60, check=False)

    def controller_url(self) -> str:
        for line in (self.run_dir / "controller.log").read_text().splitlines():
            if "controller ready: api " in line:
                return line.split("controller ready: api ")[1].split()[0]
        raise AssertionError("controller did not print its API address")


UP_BOUND_S = 240.0
"""How long ``poolgate_up`` waits for READY at most: a backstop beyond ``poolgate up``'s own bounds (its
children's ports, then ``READY_TIMEOUT_S`` until every pool that should serve answers), so that ``up``'s own
message, naming what did not come up, is what a failure shows."""


@contextlib.contextmanager
def poolgate_up(config: dict[str, Any], redis_url: str, timeout_s: float = UP_BOUND_S,
                env: dict[str, str] | None = None) -> Iterator[RunningStack]:
    """``poolgate up`` with ``config`` on free ports (and ``env`` added to its environment), until READY; on
    exit SIGTERM it and check that no process it started (children or workers, found by the run directory in
    their command line) is left. When it does not become ready, the failure carries its output and the end of
    every log in its run directory (``tests.run_dirs``: kept when a test of the session failed)."""
    run_dir = run_directory("poolgate-e2e-")
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    port, admin = free_port(), free_port()
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "poolgate.cli", "up", "--config", str(config_path), "--port", str(port),
         "--admin-port", str(admin), "--redis-url", redis_url, "--log-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    output: list[str] = []
    ready, answered = threading.Event(), threading.Event()

    def read_output() -> None:  # on after READY too, so a chatty child can never block on a full pipe
        for line in process.stdout or []:
            output.append(line)
            if line.startswith("READY "):
                ready.set()
                answered.set()
        answered.set()  # it exited

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    answered.wait(timeout_s)
    if not ready.is_set():
        stop_process(process, grace_s=30)  # it stops its children (when it has not exited already)
        reader.join(5)
        process.stdout.close()
        raise AssertionError(
            f"poolgate up did not become ready ({time.monotonic() - started:.0f} s, exit code {process.returncode}"
            f"); its output:\n{''.join(output)}\n{stack_logs(run_dir)}")
    print(f"poolgate up ready after {time.monotonic() - started:.1f} s (logs in {run_dir})")
    running = RunningStack(f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{admin}", redis_url, run_dir,
                           config_path, config, process, output)
    try:
        yield running
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        finally:
            if process.poll() is None:
                process.kill()
        reader.join(5)
        if process.stdout:
            process.stdout.close()
    pids = [*running.children().values(), *_pids_mentioning(run_dir)]
    leftovers = [pid for pid in pids if pid_alive(pid)]
    assert not leftovers, f"processes left behind: {leftovers}"


def stack_logs(run_dir: Path, lines: int = 40) -> str:
    """The last ``lines`` of every log of a stack's run directory: its children's (controller, extproc, Envoy and
    its access log) and its workers'."""
    parts = [f"logs in {run_dir}:"]
    for path in sorted([*run_dir.glob("*.log"), *run_dir.glob("workers/*.log")]):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.relative_to(run_dir)} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


def _pids_mentioning(run_dir: Path) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if str(run_dir).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
    return pids


@pytest.fixture(scope="package")
def stack(redis_server: object) -> Iterator[RunningStack]:
    """The shared stack; with the GenAI metrics on, every routed response passes through extproc."""
    config = {**E2E_CONFIG, "observability": {"genai_metrics": True, "extproc_metrics_port": free_port()}}
    with poolgate_up(config, redis_server.url) as running:  # type: ignore[attr-defined]
        yield running


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
