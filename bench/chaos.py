"""The chaos soak's stack and faults (``poolgate bench soak --chaos``).

The stack is laid out as on several machines, every part its own process: Redis as a Sentinel group (a
master, two replicas, three sentinels: ``bench.redis_deployments.SentinelGroup``; every process opens it
with the ``redis+sentinel://`` URL, through the one client factory), two controllers on it (one holds the
leader lease, the other stands by; both serve xDS and the registry API), two extproc processes, one Envoy
(its xDS cluster lists both controllers, its ext_proc cluster both extprocs) and a "node" of simulated
workers: the node starts each worker, registers it through a controller's registry API once ``/health``
answers and heartbeats for it (trying the other controller when one is down), as a node agent with a
kubelet would. A process that dies is started again on its port after ``RESTART_S``, as a process manager
would.

Faults, in turn: SIGKILL a worker, SIGKILL an extproc process, SIGKILL the leading controller (the one
whose API the lease holder announced), SIGKILL the Redis master (the sentinels promote a replica; the
killed node is started again once they have, as a replica of the new master), and delay one worker for
``DELAY_HOLD_S``. The delay is simulated: this machine's kernel is built without the ``netem`` queueing
discipline (``CONFIG_NET_SCH_NETEM`` is not set; ``tc qdisc add dev lo root netem delay 100ms`` in a
network namespace answers "Specified qdisc kind is unknown"), so the simulated worker's own fault knob
``added_latency_s`` (``POST /sim/faults``) holds every inference request before its engine instead of
delaying packets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.harness import ProcessGroup
from bench.redis_deployments import SentinelGroup, binaries_missing
from bench.sched_fleet import MODELS, POOL_MAX_MODEL_LEN
from controller.xds.bootstrap import XDS_CLUSTER, render_bootstrap
from poolgate.kernel.config import parse_config
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.redis_client import RedisLike
from poolgate.kernel.store import FleetStore, connect
from poolgate.procs import envoy_binary, free_port, wait_port

KEY_PREFIX = "chaos"
QUOTA_TENANT = "soak-quota"
WORKERS = (("chat", 3), ("code", 2))
"""Pool, simulated workers: two or more per pool, so a killed worker never empties its pool."""
PRESET = "h100-80gb"
RESTART_S = 1.0
DELAY_S = 2.0
"""Added to every request of the delayed worker."""
DELAY_HOLD_S = 30.0
REDIS_FAULT = "redis master"
DELAY_FAULT = "worker delay (simulated)"
FAULTS = ("worker", "extproc", "leader controller", REDIS_FAULT, DELAY_FAULT)
FAILOVER_WAIT_S = 60.0
"""A killed master is started again once the sentinels name another one, or after this long."""


def chaos_config(token: str, quota_key: str) -> dict[str, Any]:
    """The soak's poolgate config (YAML-shaped): two pools, one quota tenant, no controller-run workers."""
    return {
        "key_prefix": KEY_PREFIX,
        # A generous TTL: on a loaded shared host heartbeats can lag by seconds, and none is written while the
        # sentinels fail the master over (3-4 s measured at load 18-33, more on a busier host).
        "controller": {"token": token, "heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 10.0},
        "autoscale": {"lease_ttl_s": 3.0},
        "health": {"probe_interval_s": 1.0, "probe_timeout_s": 5.0},
        "scheduling": {"task_classes": {"code_models": [MODELS["code"]]}},
        "pools": [{"name": pool, "model": MODELS["chat" if pool == "chat" else "code"],
                   "max_model_len": POOL_MAX_MODEL_LEN[pool]} for pool, _ in WORKERS],
        "tenants": [{
            "name": QUOTA_TENANT, "api_key_sha256": [hashlib.sha256(quota_key.encode()).hexdigest()],
            # Limits far above what the soak sends: the counters are checked, not the refusals.
            "tokens_per_minute": 1_000_000_000, "max_concurrent": 100_000}],
    }


@dataclass
class Worker:
    id: str
    pool: str
    port: int
    registered_pid: int | None = None
    """The process that the current registration is for (None: not registered)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class FaultEvent:
    at_s: float
    fault: str
    target: str
    back_after_s: float | None = None
    """Seconds until the target served again (its port, or its registration for a worker)."""
    note: str = ""


@dataclass
class ChaosStack:
    """Every process of the soak; ``stop`` leaves none behind."""

    run_dir: Path
    token: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    quota_key: str = field(default_factory=lambda: "sk-soak-" + secrets.token_hex(12))
    group: ProcessGroup = field(init=False)
    commands: dict[str, list[str]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    """Service → the port that shows it is up."""
    workers: list[Worker] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    stopping: bool = False
    heartbeat_failures: int = 0
    heartbeat_interval_s: float = 0.0
    """The interval the registry named last (0: none yet; the config's until it names one)."""
    redis: SentinelGroup | None = None

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.group = ProcessGroup(self.run_dir)
        self.config_path = self.run_dir / "chaos.yaml"
        data = chaos_config(self.token, self.quota_key)
        self.config = parse_config(data)  # fails here, naming the field, rather than in a child's log
        self.config_path.write_text(yaml.safe_dump(data, sort_keys=False))

    @property
    def redis_url(self) -> str:
        assert self.redis is not None, "the stack has not started"
        return self.redis.url

    def open_redis(self) -> RedisLike:
        """A short-lived client of the stack's Redis, as every poolgate process opens it (following the master)."""
        return connect(self.redis_url, max_connections=None, socket_timeout=2, socket_connect_timeout=2)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['envoy']}"

    def pids(self) -> dict[str, int]:
        """Service → pid of its live process (Redis: each node and sentinel by its port)."""
        live = {name: process.pid for name, process in self.group.children.items() if process.poll() is None}
        return live | (self.redis.pids() if self.redis is not None else {})

    def _start(self, name: str, cmd: list[str], port: int) -> None:
        self.commands[name], self.ports[name] = cmd, port
        self.group.start(name, cmd)

    async def start(self) -> None:
        if (missing := binaries_missing()) is not None:
            raise SystemExit(f"the chaos soak needs Redis: {missing}")
        self.redis = await asyncio.to_thread(SentinelGroup)
        python = [sys.executable, "-m", "poolgate.cli"]
        common = ["--config", str(self.config_path), "--redis-url", self.redis_url]
        xds = {}
        for name in ("controller-a", "controller-b"):
            api, xds[name] = free_port(), free_port()
            self._start(name, [*python, "controller", *common, "--xds-port", str(xds[name]), "--http-port",
                               str(api), "--log-dir", str(self.run_dir / "unused-worker-logs"), "--no-workers"],
                        api)
            await self._wait(name, 60)  # the first one takes the lease
        extproc_ports = []
        for name in ("extproc-0", "extproc-1"):
            port = free_port()
            extproc_ports.append(port)
            self._start(name, [*python, "extproc", *common, "--port", str(port), "--metrics-port",
                               str(free_port()), "--log-level", "WARNING"], port)
        for pool, count in WORKERS:
            for number in range(1, count + 1):
                worker = Worker(f"{pool}-{number}", pool, free_port())
                self.workers.append(worker)
                self._start(worker.id, [*python, "simworker", "--port", str(worker.port), "--model",
                                        self.config.pool(pool).model, "--worker-id", worker.id, "--preset", PRESET,
                                        "--max-model-len", str(POOL_MAX_MODEL_LEN[pool]), "--enable-fault-api",
                                        "--log-level", "WARNING"], worker.port)
        for name in ("extproc-0", "extproc-1"):
            await self._wait(name, 60)
        envoy, admin = free_port(), free_port()
        bootstrap = render_bootstrap(self.config, node_id="chaos-soak", listen_port=envoy, admin_port=admin,
                                     extproc_port=tuple(extproc_ports), xds_port=xds["controller-a"])
        _add_xds_endpoint(bootstrap, xds["controller-b"])
        path = self.run_dir / "envoy.yaml"
        path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        self._start("envoy", [str(envoy_binary()), "-c", str(path), "-l", "warning", "--use-dynamic-base-id",
                              "--disable-hot-restart"], admin)
        self.ports["envoy"] = envoy
        await self._wait("envoy", 60)

    async def _wait(self, name: str, timeout_s: float) -> None:
        if not await wait_port("127.0.0.1", self.ports[name], timeout_s):
            raise RuntimeError(f"{name} did not start (log: {self.run_dir / (name + '.log')})")

    def stop(self) -> None:
        self.stopping = True
        self.group.stop_all()
        if self.redis is not None:
            self.redis.stop()

    # The process manager and the node.

    async def supervise(self, http: aiohttp.ClientSession) -> None:
        """Until ``stopping``: start dead processes again, keep the workers registered and heartbeating."""
        last_beat = 0.0
        died_at: dict[str, float] = {}
        while not self.stopping:
            for name, process in list(self.group.children.items()):
                if process.poll() is None:
                    continue
                if time.monotonic() - died_at.setdefault(name, time.monotonic()) >= RESTART_S:
                    del died_at[name]
                    self.group.start(name, self.commands[name])
                    self.restarts[name] = self.restarts.get(name, 0) + 1
            await self._register_ready(http)
            interval_s = self.heartbeat_interval_s or self.config.controller.heartbeat_interval_s
            if time.monotonic() - last_beat >= interval_s:
                last_beat = time.monotonic()
                await self._heartbeat(http)
            await asyncio.sleep(0.1)

    def _controller_apis(self) -> list[str]:
        live = self.pids()
        names = [n for n in ("controller-a", "controller-b") if n in live]
        return [f"http://127.0.0.1:{self.ports[n]}" for n in names]

    async def _api(self, http: aiohttp.ClientSession, path: str, body: Mapping[str, Any]) -> tuple[int, Any]:
        """POST to the first controller that answers; (0, None) when none did."""
        for api in self._controller_apis():
            try:
                async with http.post(api + path, json=body, headers={"authorization": f"Bearer {self.token}"},
                                     timeout=aiohttp.ClientTimeout(total=2)) as response:
                    return response.status, await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                continue
        return 0, None

    async def _register_ready(self, http: aiohttp.ClientSession) -> None:
        live = self.pids()
        for worker in self.workers:
            pid = live.get(worker.id)
            if pid is None or pid == worker.registered_pid:
                continue
            try:
                async with http.get(worker.url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as response:
                    if response.status != 200:
                        continue
            except (aiohttp.ClientError, TimeoutError):
                continue
            status, _ = await self._api(http, "/v1/workers", {"id": worker.id, "pool": worker.pool,
                                                              "host": "127.0.0.1", "port": worker.port,
                                                              "backend": "sim"})
            if status == 201:
                worker.registered_pid = pid

    async def _heartbeat(self, http: aiohttp.ClientSession) -> None:
        live = self.pids()
        for worker in self.workers:
            if worker.registered_pid is not None and live.get(worker.id) != worker.registered_pid:
                worker.registered_pid = None  # its process died: no more heartbeats for it
        beating = [w for w in self.workers if w.registered_pid is not None]
        if not beating:
            return
        status, answer = await self._api(http, "/v1/heartbeats", {"workers": [{"id": w.id} for w in beating]})
        if status != 200:
            self.heartbeat_failures += 1
            return
        self.heartbeat_interval_s = float((answer or {}).get("heartbeat_interval_s") or 0.0)
        for missing in (answer or {}).get("not_registered", ()):
            for worker in beating:
                if worker.id == missing:
                    worker.registered_pid = None  # expired (a long Redis outage): register again

    # Faults.

    async def leader(self) -> str | None:
        """The controller whose API the lease holder announced."""
        redis = self.open_redis()
        try:
            url = await FleetStore(redis, KEY_PREFIX).controller_url()
        except REDIS_ERRORS:
            return None
        finally:
            await redis.aclose()
        return next((n for n in ("controller-a", "controller-b") if url and url.endswith(f":{self.ports[n]}")),
                    None)

    def kill(self, name: str) -> bool:
        process = self.group.children.get(name)
        if process is None or process.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for worker in self.workers:
            if worker.id == name:
                worker.registered_pid = None  # the node stops heartbeating for it and registers its successor
        return True

    async def set_delay(self, http: aiohttp.ClientSession, worker: Worker, seconds: float) -> bool:
        try:
            async with http.post(worker.url + "/sim/faults", json={"added_latency_s": seconds},
                                 timeout=aiohttp.ClientTimeout(total=5)) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def redis_serves(self) -> bool:
        """The master the sentinels name takes a write (a replica would refuse it)."""
        redis = self.open_redis()
        try:
            return bool(await redis.set(f"{KEY_PREFIX}:chaos-probe", "1", px=10_000))
        except REDIS_ERRORS:
            return False
        finally:
            await redis.aclose()

    async def fail_redis_master(self) -> int:
        """Kill the master (SIGKILL); returns its port. ``restart_redis_node`` brings the node back."""
        assert self.redis is not None
        return await asyncio.to_thread(self.redis.fail_master)

    async def restart_redis_node(self, port: int) -> int | None:
        """Once the sentinels name another master (or after ``FAILOVER_WAIT_S``), start the killed node again:
        a process manager brings the crashed machine's Redis back, and it joins as a replica. Returns the
        port of the master the sentinels promoted (None: none within the wait)."""
        assert self.redis is not None
        deadline = time.monotonic() + FAILOVER_WAIT_S
        promoted = None
        while not self.stopping and time.monotonic() < deadline:
            with contextlib.suppress(*REDIS_ERRORS):
                if (master := await asyncio.to_thread(self.redis.current_master)) != port:
                    promoted = master
                    break
            await asyncio.sleep(0.2)
        if not self.stopping:
            await asyncio.to_thread(self.redis.restart, port)
        return promoted

    async def back_after(self, name: str, since: float, timeout_s: float = 120.0) -> float | None:
        """Seconds from ``since`` until ``name`` serves again (a worker: registered again; Redis: a master
        takes writes)."""
        worker = next((w for w in self.workers if w.id == name), None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if worker is not None:
                if worker.registered_pid is not None:
                    return time.monotonic() - since
            elif name == REDIS_FAULT:
                if await self.redis_serves():
                    return time.monotonic() - since
            elif name in self.pids() and await wait_port("127.0.0.1", self.ports[name], 0.5):
                return time.monotonic() - since
            await asyncio.sleep(0.1)
        return None


def _add_xds_endpoint(bootstrap: dict[str, Any], port: int) -> None:
    """A second controller in Envoy's xDS cluster: when one controller goes, Envoy reconnects to the other."""
    cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == XDS_CLUSTER)
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    second = yaml.safe_load(yaml.safe_dump(endpoints[0]))
    second["endpoint"]["address"]["socket_address"]["port_value"] = port
    endpoints.append(second)


class FaultPlan:
    """Faults in turn, one every ``every_s`` from ``first_s``; each kind rotates over its targets."""

    def __init__(self, stack: ChaosStack, every_s: float, first_s: float) -> None:
        self.stack = stack
        self.every_s = every_s
        self.next_at = first_s
        self.turn = 0
        self.events: list[FaultEvent] = []
        self._rounds: dict[str, int] = {}
        self._background: set[asyncio.Task[None]] = set()

    def _target(self, kind: str, targets: Sequence[str]) -> str:
        index = self._rounds.get(kind, 0)
        self._rounds[kind] = index + 1
        return targets[index % len(targets)]

    async def tick(self, http: aiohttp.ClientSession, elapsed_s: float) -> None:
        if elapsed_s < self.next_at:
            return
        self.next_at += self.every_s
        kind = FAULTS[self.turn % len(FAULTS)]
        self.turn += 1
        stack = self.stack
        since = time.monotonic()
        event = FaultEvent(elapsed_s, kind, "")
        if kind == "worker":
            event.target = self._target(kind, [w.id for w in stack.workers])
        elif kind == "extproc":
            event.target = self._target(kind, ["extproc-0", "extproc-1"])
        elif kind == "leader controller":
            event.target = await stack.leader() or ""
            if not event.target:
                event.note = "no leader announced; nothing killed"
        elif kind == REDIS_FAULT:
            port = await stack.fail_redis_master()
            event.target = f"redis-{port}"
            self._spawn(self._note_back(event, since, REDIS_FAULT))
            self._spawn(self._fail_over(event, port))
        else:
            worker = stack.workers[-1 - self._rounds.get(kind, 0) % len(stack.workers)]
            self._rounds[kind] = self._rounds.get(kind, 0) + 1
            event.target = worker.id
            if await stack.set_delay(http, worker, DELAY_S):
                event.note = f"+{DELAY_S:g} s per request for {DELAY_HOLD_S:g} s"
                self._spawn(self._undelay(http, worker))
            else:
                event.note = "the worker did not take the delay"
        self.events.append(event)
        if kind not in (REDIS_FAULT, DELAY_FAULT) and event.target and stack.kill(event.target):
            self._spawn(self._note_back(event, since, event.target))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _undelay(self, http: aiohttp.ClientSession, worker: Worker) -> None:
        await asyncio.sleep(DELAY_HOLD_S)
        await self.stack.set_delay(http, worker, 0.0)

    async def _fail_over(self, event: FaultEvent, port: int) -> None:
        promoted = await self.stack.restart_redis_node(port)
        event.note = f"Sentinel failover to redis-{promoted}" if promoted else "no failover within the wait"

    async def _note_back(self, event: FaultEvent, since: float, serving: str) -> None:
        event.back_after_s = await self.stack.back_after(serving, since)

    async def settle(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=DELAY_HOLD_S + 5)
