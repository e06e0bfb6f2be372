"""A stack the fault tests own piece by piece: Redis, controller, extproc, two Envoys and simulated workers,
each its own process group, so a test kills and restarts exactly one and nothing restarts behind its back.

Workers register and heartbeat straight into Redis (as a per-node agent or the Kubernetes sync would), not
through the controller, so a controller outage is only an xDS outage. Two Envoy + extproc pairs share the
controller, Redis and workers: one fail-open (extproc and quotas), the other fail-closed (503 JSON when extproc
is away, 503 ``quota_unavailable`` when Redis is).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx
import orjson
import redis.asyncio as aioredis
import yaml

from controller.xds.bootstrap import render_bootstrap
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore
from poolgate.procs import envoy_binary, free_port, port_open

T = TypeVar("T")
PREFIX = "faults"
MODEL = "chat-model"
TOKEN = "fault-token"
FAULT_CONFIG: dict[str, Any] = {
    "key_prefix": PREFIX,
    "controller": {"token": TOKEN, "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "extproc": {"max_request_bytes": 1048576},
    "health": {"probe_interval_s": 0.25, "probe_timeout_s": 1.0},
    "pools": [{"name": "chat", "model": MODEL, "max_model_len": 8192}],
}
QUOTA_TENANT = {"name": "default", "requests_per_minute": 1_000_000}
"""Requests without a key belong to ``default``; giving it a (never reached) limit puts a Redis quota call on
every request, so a Redis outage shows how quotas degrade."""
CLOSED_CONFIG: dict[str, Any] = {
    **FAULT_CONFIG,
    "extproc": {**FAULT_CONFIG["extproc"], "fail_open": False},
    "tenancy": {"quota_fail_open": False},
    "tenants": [QUOTA_TENANT],
}
OPEN_CONFIG: dict[str, Any] = {**FAULT_CONFIG, "tenants": [QUOTA_TENANT]}
WORKER_IDS = ("w1", "w2", "w3")


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``condition`` every 20 ms; the time it took, or AssertionError naming ``what``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if condition():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout_s} s")


class BackgroundLoop:
    """An asyncio loop on a daemon thread: load generators and heartbeats run there while a test acts."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


@dataclass
class Proc:
    """One child in its own session (process group); ``kill`` takes the whole group."""

    name: str
    cmd: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Heartbeats:
    """Registers the simulated workers in Redis and keeps them alive; re-registers after Redis lost them."""

    redis_url: str
    records: dict[str, WorkerRecord]
    interval_s: float = 0.25
    ttl_s: float = 1.0
    paused: set[str] = field(default_factory=set)
    failures: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        client = aioredis.from_url(self.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        store = FleetStore(client, PREFIX)
        try:
            while not stop.is_set():
                for worker_id, record in list(self.records.items()):
                    if worker_id in self.paused:
                        continue
                    try:
                        if not await store.heartbeat(worker_id, self.ttl_s):
                            await store.register(record, self.ttl_s)
                    except (aioredis.RedisError, OSError):
                        self.failures += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)
        finally:
            await client.aclose()


class FaultStack:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.config_path = run_dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(OPEN_CONFIG))
        closed_path = run_dir / "closed.yaml"
        closed_path.write_text(yaml.safe_dump(CLOSED_CONFIG))
        config, closed = parse_config(OPEN_CONFIG), parse_config(CLOSED_CONFIG)
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.xds_port, self.api_port, self.extproc_port, self.metrics_port = (free_port() for _ in range(4))
        self.closed_extproc_port, self.closed_metrics_port = free_port(), free_port()
        self.envoy_port, self.admin_port, self.closed_port, self.closed_admin = (free_port() for _ in range(4))
        python = [sys.executable, "-m", "poolgate.cli"]
        common = ["--config", str(self.config_path), "--redis-url", self.redis_url]
        redis_binary = shutil.which("redis-server")
        assert redis_binary, "redis-server is not installed"
        self.redis = Proc("redis", [redis_binary, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", str(run_dir)], run_dir / "redis.log")
        self.controller = Proc("controller", [*python, "controller", *common, "--no-workers", "--xds-port",
                                              str(self.xds_port), "--http-port", str(self.api_port), "--log-dir",
                                              str(run_dir / "workers")], run_dir / "controller.log")
        self.extproc = Proc("extproc", [*python, "extproc", *common, "--port", str(self.extproc_port),
                                        "--metrics-port", str(self.metrics_port)], run_dir / "extproc.log")
        self.extproc_closed = Proc("extproc-closed", [
            *python, "extproc", "--config", str(closed_path), "--redis-url", self.redis_url, "--port",
            str(self.closed_extproc_port), "--metrics-port", str(self.closed_metrics_port)],
            run_dir / "extproc-closed.log")
        envoys = []
        for name, settings, port, admin, extproc_port in (
                ("envoy", config, self.envoy_port, self.admin_port, self.extproc_port),
                ("envoy-closed", closed, self.closed_port, self.closed_admin, self.closed_extproc_port)):
            bootstrap = render_bootstrap(settings, node_id=f"poolgate-{name}", listen_port=port, admin_port=admin,
                                         extproc_port=extproc_port, xds_port=self.xds_port)
            path = run_dir / f"{name}.yaml"
            path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
            envoys.append(Proc(name, [str(envoy_binary()), "-c", str(path), "-l", "warning", "--use-dynamic-base-id",
                                      "--disable-hot-restart"], run_dir / f"{name}.log"))
        self.envoy, self.envoy_closed = envoys
        self.worker_ports = {worker_id: free_port() for worker_id in WORKER_IDS}
        self.workers = {
            worker_id: Proc(worker_id, [*python, "simworker", "--port", str(port), "--model", MODEL, "--worker-id",
                                        worker_id, "--time-scale", "4"], run_dir / f"{worker_id}.log")
            for worker_id, port in self.worker_ports.items()}
        self.heartbeats = Heartbeats(self.redis_url, {
            worker_id: WorkerRecord(id=worker_id, pool="chat", model=MODEL, host="127.0.0.1", port=port,
                                    backend="external")
            for worker_id, port in self.worker_ports.items()})
        self.background = BackgroundLoop()
        self._stop_heartbeats = asyncio.Event()
        self._heartbeat_task: concurrent.futures.Future[None] | None = None

    @property
    def procs(self) -> list[Proc]:
        return [self.redis, *self.workers.values(), self.controller, self.extproc, self.extproc_closed, self.envoy,
                self.envoy_closed]

    def start(self) -> None:
        self.redis.start()
        wait_until(lambda: port_open("127.0.0.1", self.redis_port), 15, "redis listening")
        for worker in self.workers.values():
            worker.start()
        self._heartbeat_task = asyncio.run_coroutine_threadsafe(
            self.heartbeats.run(self._stop_heartbeats), self.background.loop)
        self.controller.start()
        self.extproc.start()
        self.extproc_closed.start()
        wait_until(lambda: port_open("127.0.0.1", self.xds_port), 30, "controller xDS listening")
        wait_until(lambda: port_open("127.0.0.1", self.extproc_port), 30, "extproc listening")
        wait_until(lambda: port_open("127.0.0.1", self.closed_extproc_port), 30, "fail-closed extproc listening")
        self.envoy.start()
        self.envoy_closed.start()
        wait_until(lambda: self.serving(self.envoy_port) and self.serving(self.closed_port), 60, "stack serving")

    def restart(self, proc: Proc, port: int) -> float:
        """Start ``proc`` again and wait for its port; seconds until it listens."""
        proc.start()
        return wait_until(lambda: port_open("127.0.0.1", port), 30, f"{proc.name} listening again")

    def serving(self, port: int) -> bool:
        try:
            response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=5, json={
                "model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def metric(self, name: str, port: int | None = None) -> float | None:
        """One sample of extproc's Prometheus page whose line starts with ``name`` (None when absent)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{port or self.metrics_port}/metrics", timeout=1).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    def envoy_stat(self, name: str, admin_port: int | None = None) -> str:
        return envoy_stat(admin_port or self.admin_port, name)

    def envoy_endpoints(self, admin_port: int | None = None) -> dict[str, str]:
        return envoy_endpoints(admin_port or self.admin_port)

    def xds_versions(self) -> tuple[str, str]:
        return xds_versions(self.admin_port)

    def stop(self) -> None:
        self._stop_heartbeats_now()
        for proc in reversed(self.procs):
            if proc.alive():
                proc.kill(signal.SIGTERM)
            proc.kill(signal.SIGKILL)  # anything its group left behind
        self.background.close()

    def _stop_heartbeats_now(self) -> None:
        self.background.loop.call_soon_threadsafe(self._stop_heartbeats.set)
        if self._heartbeat_task is not None:
            with contextlib.suppress(Exception):
                self._heartbeat_task.result(5)

    def leftovers(self, settle_s: float = 5.0) -> list[str]:
        """The stack's processes whose group still has a live member once ``settle_s`` has passed (a child of a
        killed process, like the controller's registry API processes, may stay a zombie until it is reaped)."""
        deadline = time.monotonic() + settle_s
        while True:
            left = [proc.name for proc in self.procs
                    if proc.process is not None and _group_has_live_member(proc.process.pid)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)


def _group_has_live_member(pgid: int) -> bool:
    """A process of group ``pgid`` that is running (not a zombie), read from ``/proc``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            state, _parent, group = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            return True
    return False


@dataclass
class Sample:
    sent_at: float
    """Monotonic time the request was sent."""
    latency_s: float
    status: int
    ok: bool
    error: str = ""


@dataclass
class LoadResult:
    samples: list[Sample]

    @property
    def sent(self) -> int:
        return len(self.samples)

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok]

    def failures_between(self, start: float, end: float) -> int:
        """Failed requests answered within [start, end] (monotonic)."""
        return sum(1 for s in self.samples if not s.ok and start <= s.sent_at + s.latency_s <= end)

    def last_failure(self) -> float | None:
        return max((s.sent_at for s in self.samples if not s.ok), default=None)


CHAT_BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4})


async def steady_load(port: int, rate_per_s: float, stop: asyncio.Event, body: bytes = CHAT_BODY,
                      timeout_s: float = 10.0, accept: Callable[[int, bytes], bool] | None = None) -> LoadResult:
    """Open-loop chat requests at ``rate_per_s`` until ``stop``; every request's outcome is kept."""
    samples: list[Sample] = []
    accept = accept or (lambda status, _: status == 200)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    tasks: set[asyncio.Task[None]] = set()

    async def one(session: aiohttp.ClientSession) -> None:
        sent = time.monotonic()
        try:
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as response:
                payload = await response.read()
                samples.append(Sample(sent, time.monotonic() - sent, response.status,
                                      accept(response.status, payload), payload[:200].decode(errors="replace")))
        except (aiohttp.ClientError, TimeoutError) as exc:
            samples.append(Sample(sent, time.monotonic() - sent, 0, False, repr(exc)))

    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        period = 1.0 / rate_per_s
        next_at = time.monotonic()
        while not stop.is_set():
            task = asyncio.create_task(one(session))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s + 1)
    return LoadResult(samples)


class LoadRun:
    """``with LoadRun(stack, port, rate) as load:`` keeps load on while the block runs; ``load.result`` after."""

    def __init__(self, stack: FaultStack, port: int, rate_per_s: float, **kwargs: Any) -> None:
        self._stack = stack
        self._stop = asyncio.Event()
        self._future = asyncio.run_coroutine_threadsafe(steady_load(port, rate_per_s, self._stop, **kwargs),
                                                        stack.background.loop)
        self.result = LoadResult([])

    def __enter__(self) -> LoadRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.background.loop.call_soon_threadsafe(self._stop.set)
        self.result = self._future.result(30)


def report(case: str, result: LoadResult, recovery_s: float | None, extra: str = "") -> str:
    """The one figures line every fault case prints."""
    failed = len(result.failed)
    succeeded = result.sent - failed
    recovered = f"{recovery_s:.2f} s" if recovery_s is not None else "n/a"
    line = (f"FAULT {case}: sent {result.sent}, succeeded {succeeded}, failed {failed}, "
            f"time to recover {recovered}{', ' + extra if extra else ''}")
    print("\n" + line, flush=True)
    return line


def fault_stack_fixture(run_dir: Path) -> Iterator[FaultStack]:
    stack = FaultStack(run_dir)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
    left = stack.leftovers()
    assert not left, f"processes left behind: {left}"


def envoy_stat(admin_port: int, name: str) -> str:
    """One stat of the Envoy whose admin listens on ``admin_port`` ("" when it has none)."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/stats?filter=^{name}$", timeout=5).text
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return value
    return ""


def envoy_endpoints(admin_port: int) -> dict[str, str]:
    """Pool chat's hosts in Envoy → health flags (admin /clusters)."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=5).text
    hosts: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) >= 4 and parts[0] == "pool-chat" and parts[2] == "health_flags":
            hosts[parts[1]] = parts[3]
    return hosts


def xds_versions(admin_port: int) -> tuple[str, str]:
    """What Envoy accepted last: the CDS version (the controller's content hash) and pool chat's EDS
    content hash (Envoy's ``version`` stat of the cluster)."""
    dump = httpx.get(f"http://127.0.0.1:{admin_port}/config_dump?resource=dynamic_active_clusters",
                     timeout=5).json()
    cds = sorted({c.get("version_info", "") for c in dump.get("configs", [])})
    return ",".join(cds), envoy_stat(admin_port, "cluster.pool-chat.version")
