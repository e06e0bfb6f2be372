"""``poolgate bench scale --workers N [N…] --pools P [P…]``: the fleet path at N workers in P pools.

A real stack, as ``poolgate up`` runs it: redis-server, the controller (registry API, health monitor, xDS),
extproc and two Envoys on ADS. Fake workers are addresses on loopback (``127.1.x.y``) answered by two small
HTTP servers (``/health``, ``/v1/models``, ``/metrics``), one for the workers that will fail and one for the
rest; they register and heartbeat through the registry API at the configured interval, as external
workers do, each at the interval the registry's last answer named (``--node-batch K``: a node agent heartbeats
K workers in one call; 0: per worker, each its own call), each node (or worker) over its own kept-alive
connection with a lean client, so that this process is not what runs out of CPU first. ``--node-batch 0 8``
measures both modes, one row each. Per size it reports:

- registration rate through the API (``--concurrency`` clients at once);
- heartbeat success (2xx share; a 404 means the worker expired and it registers again, as a worker would) and
  the interval the registry named (median over the steady phase's answers);
- time from the last registration until every Envoy lists all N endpoints healthy;
- one-change latency: a worker reports Draining (then Ready) in a call of its own (its node's batches carry
  no state, as poolgate's agent sends them) and every Envoy's healthy count follows; p50/p99 over
  ``--changes`` changes, and the part of it until the API answered the heartbeat (written to Redis);
  measured by a process of its own (``in_observer``), as is the mass failure below. Each Envoy is polled every
  ``CHANGE_POLL_S``, and the change counts as shown in it when Envoy says it applied the update that showed it
  (its cluster's ``update_time`` gauge, in ms): polled every 5 ms, each poll costing an Envoy 1.5 ms of CPU
  at 10,000 workers, the observer took 0.2-0.3 of a core per Envoy from the stack it measured, and its
  poll spacing added to every figure. The time until the poll saw it is reported beside
  (``change_polled_*``, an upper bound);
- passive ejection: ``--sick`` workers of a pool of their own (beside as many healthy ones) answer their
  probes but fail every request with a 500; requests go through one Envoy until no Envoy lists them healthy
  (the other Envoy sees no traffic: only the controller's verdict takes them out of it); time from the first
  request, and requests that failed;
- a stall of the registry API (``--stall-api-s``): its processes are stopped for that long (as a starved host
  or a lost network would keep every heartbeat from it), more than the heartbeat TTL; how far every Envoy's
  healthy count fell, how long from the stall's start until it was whole again, and how many workers
  registered again;
- mass-failure ejection: ``--fail`` workers stop answering at once while their heartbeats go on; with
  ``--fail-mode exit`` their server process exits (a crashed engine: connections close, new ones are
  refused), with ``hang`` it is stopped (a hung engine: connections stay open and nothing answers, so every
  probe waits for its timeout); time until no Envoy lists them healthy, and the confirming probes the health
  monitor sent while the probes they confirm were still out;
- silent workers (``--silent K``): K workers stop heartbeating while they still answer their probes (a registrant
  that died, or lost its way to the registry): time until no Envoy lists them, by their TTL alone;
- the health monitor's round time (a hung worker waits up to a round for its probe), CPU (share of one core)
  and RSS per process, Redis commands/s, extproc's snapshot age (p50/p99), and how late this process's own
  loop ran (``load_loop_lag_p99_s``), over a steady phase of ``--steady-s`` seconds.

The documented full run is ``--workers 1000 5000 10000 --pools 1 200``. Results print as a table and go
to ``bench/reports/scale.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
import yaml

from bench import fake_workers, host_quiet
from bench.harness import ProcessGroup, cpu_seconds, cpu_times
from bench.measure import percentile
from bench.report import Column, Panel, save_rows
from controller.xds.bootstrap import render_bootstrap
from controller.xds.endpoint_table import LARGE_CLUSTER, suggested_shards
from poolgate.kernel.coarse_timers import CoarseTimer, coarse_timers
from poolgate.kernel.config import parse_config
from poolgate.kernel.heap import freeze_startup_objects
from poolgate.kernel.lean_http import LeanHttpClient, PeerClosed
from poolgate.kernel.routing import cluster_name, pool_clusters, worker_cluster
from poolgate.procs import envoy_binary, free_port, wait_port

TOKEN = "bench-scale-token"
MODEL = "scale-model"
SICK_MODEL = "scale-sick-model"
SICK_POOL = "sick"
SICK_BURST_PER_WORKER = 3
"""The phase opens with this many requests per worker of the sick pool at once (each sick worker gets about
``health.passive_failures_to_fail`` failures together, so the time measured is the path's, not the traffic's)."""
SICK_RATE = 40.0
"""Requests per second after the burst: little enough that the traffic does not take the CPU the fleet's
heartbeats need on this one machine (closed loops of 4 did, and expired thousands of workers)."""
ENVOYS = ("a", "b")
REPO_ROOT = Path(__file__).resolve().parent.parent
HEARTBEAT_TIMEOUT_S = 30.0
"""A heartbeat call that takes longer counts as failed."""
FAKE_WORKERS_NICE = 10
"""The fake workers' scheduling priority (``nice``): they stand for the fleet's own machines."""


@dataclass(frozen=True)
class Worker:
    id: str
    pool: str
    host: str
    port: int


@dataclass
class Counters:
    ok: int = 0
    expired: int = 0
    failed: int = 0
    reregistered: int = 0
    registration_errors: int = 0
    registrations_deferred: int = 0
    """Registrations the API put off (503 with Retry-After: it ran behind); retried after that delay."""
    latencies: list[float] = field(default_factory=list)
    """Seconds per heartbeat call (the steady phase's quantiles are reported)."""
    intervals: list[float] = field(default_factory=list)
    """The intervals the registry named in its answers (the steady phase's median is reported)."""

    @property
    def success(self) -> float:
        total = self.ok + self.expired + self.failed
        return self.ok / total if total else float("nan")


@dataclass
class Stack:
    group: ProcessGroup
    api: str
    admin_ports: dict[str, int]
    extproc_metrics: str
    redis_port: int
    pids: dict[str, int] = field(default_factory=dict)
    listener: str = ""
    """The first Envoy's listener (the other takes no requests)."""


def fleet(n: int, pools: int, fail: int, alive_port: int, doomed_port: int) -> list[Worker]:
    """N workers round-robin over the pools; the first ``fail`` answer on the port that will be stopped."""
    return [Worker(f"w{i:05d}", f"p{i % pools}", f"127.1.{i // 250}.{i % 250 + 1}",
                   doomed_port if i < fail else alive_port) for i in range(n)]


def sick_pool(sick: int, alive_port: int, sick_port: int) -> list[Worker]:
    """The sick pool: ``sick`` workers that fail every request, then as many healthy ones."""
    return [Worker(f"s{i:04d}", SICK_POOL, f"127.2.{i // 250}.{i % 250 + 1}", sick_port if i < sick else alive_port)
            for i in range(2 * sick)]


def write_config(run_dir: Path, pools: int, heartbeat_interval_s: float | None = None, api_processes: int = 0,
                 sick: bool = False, shards: int = 1) -> Path:
    """The stack's config; ``heartbeat_interval_s`` (TTL three intervals) replaces the default timing, as
    ``api_processes`` does the default count (0: one per core); the measured pools are split over ``shards``
    clusters each."""
    controller: dict[str, Any] = {"token": TOKEN}
    if api_processes > 0:
        controller["api_processes"] = api_processes
    if heartbeat_interval_s is not None:
        controller.update(heartbeat_interval_s=heartbeat_interval_s, heartbeat_ttl_s=3 * heartbeat_interval_s)
    config = {"pools": [{"name": f"p{i}", "model": MODEL, "endpoint_shards": shards} for i in range(pools)]
              + ([{"name": SICK_POOL, "model": SICK_MODEL}] if sick else []),
              "controller": controller, "health": {"check_models": True}}
    parse_config(config)  # fails here, with the field named, rather than in a child's log
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def start_stack(run_dir: Path, config_path: Path, group: ProcessGroup) -> Stack:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise SystemExit("redis-server is needed: apt-get install redis-server")
    ports = {name: free_port() for name in ("redis", "xds", "api", "extproc", "extproc_metrics",
                                            *(f"envoy_{e}" for e in ENVOYS), *(f"admin_{e}" for e in ENVOYS))}
    redis_url = f"redis://127.0.0.1:{ports['redis']}/0"
    python = [sys.executable, "-m", "poolgate.cli"]
    pids = {"redis": group.start("redis", [redis_server, "--port", str(ports["redis"]), "--save", "",
                                           "--appendonly", "no"]).pid}
    await wait_port("127.0.0.1", ports["redis"], 10)
    pids["controller"] = group.start("controller", [
        *python, "controller", "--config", str(config_path), "--redis-url", redis_url, "--xds-port",
        str(ports["xds"]), "--http-port", str(ports["api"]), "--no-workers"]).pid
    pids["extproc"] = group.start("extproc", [
        *python, "extproc", "--config", str(config_path), "--redis-url", redis_url, "--port",
        str(ports["extproc"]), "--metrics-port", str(ports["extproc_metrics"])]).pid
    for name in ("api", "xds", "extproc", "extproc_metrics"):
        if not await wait_port("127.0.0.1", ports[name], 60):
            raise RuntimeError(f"{name} did not start; logs in {run_dir}")
    config = parse_config(yaml.safe_load(await asyncio.to_thread(config_path.read_text)))
    for envoy in ENVOYS:
        bootstrap = render_bootstrap(config, node_id=f"scale-{envoy}", listen_port=ports[f"envoy_{envoy}"],
                                     admin_port=ports[f"admin_{envoy}"], extproc_port=ports["extproc"],
                                     xds_port=ports["xds"])
        path = run_dir / f"envoy-{envoy}.yaml"
        path.write_text(yaml.safe_dump(bootstrap))
        pids[f"envoy_{envoy}"] = group.start(f"envoy-{envoy}", [
            str(envoy_binary()), "-c", str(path), "-l", "error", "--use-dynamic-base-id",
            "--disable-hot-restart", "--concurrency", "1"]).pid
    for envoy in ENVOYS:
        if not await wait_port("127.0.0.1", ports[f"admin_{envoy}"], 60):
            raise RuntimeError(f"envoy {envoy} did not start; logs in {run_dir}")
    return Stack(group, f"http://127.0.0.1:{ports['api']}", {e: ports[f"admin_{e}"] for e in ENVOYS},
                 f"http://127.0.0.1:{ports['extproc_metrics']}/metrics", ports["redis"], pids,
                 f"http://127.0.0.1:{ports[f'envoy_{ENVOYS[0]}']}")


_MEMBERSHIP = re.compile(r"^cluster\.(.+)\.membership_healthy: (\d+)$", re.M)
_UPDATE_TIME = re.compile(r"^cluster\.(.+)\.update_time: (\d+)$", re.M)
CHANGE_POLL_S = 0.025
"""How often the one-change phase asks each Envoy for its count (the time it shows comes from Envoy's stamp)."""


def pool_names(pools: int) -> list[str]:
    """The measured pools (the sick pool is apart)."""
    return [f"p{i}" for i in range(pools)]


def clusters_of(pools: Sequence[str], shards: int = 1) -> list[str]:
    """The Envoy clusters of ``pools``, each split over ``shards`` (``PoolSpec.endpoint_shards``)."""
    return [cluster for pool in pools for cluster in pool_clusters(pool, shards)]


def auto_shards(workers_per_pool: int) -> int:
    """The ``endpoint_shards`` the controller's warning asks of a pool this large (1 up to ``LARGE_CLUSTER``)."""
    return 1 if workers_per_pool <= LARGE_CLUSTER else suggested_shards(workers_per_pool)


async def envoy_gauges(http: aiohttp.ClientSession, admin: str, pattern: str) -> str:
    """The gauges whose names match ``pattern`` in the Envoy whose admin is at ``admin``, as its ``/stats`` text."""
    async with http.get(f"{admin}/stats", params={"filter": pattern, "type": "Gauges"}) as r:
        return await r.text()


async def envoy_healthy(http: aiohttp.ClientSession, admin: str, clusters: Sequence[str]) -> int:
    """Healthy endpoints over ``clusters`` in the Envoy whose admin is at ``admin``. Asked for gauges only, and
    for a few clusters by name: Envoy walks every stat it has for each call (~15 ms at 200 pools), which would
    blur what is measured and take CPU from what is."""
    wanted = set(clusters)
    named = "|".join(re.escape(name) for name in sorted(wanted))
    text = await envoy_gauges(http, admin, rf"^cluster\.({named})\.membership_healthy$" if len(wanted) <= 8
                              else "membership_healthy")
    return sum(int(n) for name, n in _MEMBERSHIP.findall(text) if name in wanted)


async def envoy_cluster(http: aiohttp.ClientSession, admin: str, cluster: str) -> tuple[int, float]:
    """One cluster's healthy endpoints in the Envoy whose admin is at ``admin``, and when (wall clock, s) that
    Envoy last applied an update of it."""
    text = await envoy_gauges(http, admin, rf"^cluster\.{re.escape(cluster)}\.(membership_healthy|update_time)$")
    updated = [int(ms) / 1000 for name, ms in _UPDATE_TIME.findall(text) if name == cluster]
    return (sum(int(n) for name, n in _MEMBERSHIP.findall(text) if name == cluster),
            updated[0] if updated else float("nan"))


async def healthy_counts(http: aiohttp.ClientSession, admin_ports: Mapping[str, int],
                         clusters: Sequence[str]) -> dict[str, int]:
    """``envoy_healthy`` per Envoy (by admin port)."""
    return {envoy: await envoy_healthy(http, f"http://127.0.0.1:{port}", clusters)
            for envoy, port in admin_ports.items()}


async def sick_ejection(http: aiohttp.ClientSession, stack: Stack, sick: int, timeout_s: float) -> dict[str, Any]:
    """Requests to the sick pool's model through the first Envoy (a burst, then ``SICK_RATE`` a second) until
    every Envoy lists only its healthy half."""
    statuses: list[int] = []

    async def send() -> None:
        # prompts of their own, as users send: one prompt again and again would follow prefix affinity
        body = {"model": SICK_MODEL, "prompt": f"question {random.getrandbits(64):x}", "max_tokens": 1}
        try:
            async with http.post(f"{stack.listener}/v1/completions", json=body) as r:
                await r.read()
                statuses.append(r.status)
        except aiohttp.ClientError:
            statuses.append(0)

    async def paced() -> None:
        requests = {asyncio.create_task(send()) for _ in range(SICK_BURST_PER_WORKER * 2 * sick)}
        try:
            while True:
                task = asyncio.create_task(send())
                requests.add(task)
                task.add_done_callback(requests.discard)
                await asyncio.sleep(1 / SICK_RATE)
        finally:
            await asyncio.gather(*requests, return_exceptions=True)

    sender = asyncio.create_task(paced())
    try:
        out = await wait_counts(http, stack.admin_ports, [cluster_name(SICK_POOL)], lambda c: c <= sick, timeout_s,
                                poll_s=0.01)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
    return {"sick_out_s": out, "sick_requests": len(statuses),
            "sick_failed_requests": sum(1 for status in statuses if status != 200)}


async def api_stall(http: aiohttp.ClientSession, stack: Stack, fleet_: Fleet, clusters: Sequence[str],
                    stall_s: float, timeout_s: float) -> dict[str, Any]:
    """Stop the registry API for ``stall_s`` (its processes; the controller where it serves the API itself) while
    the fleet heartbeats on; follow every Envoy's healthy count until it is back where it was."""
    async def lowest_count() -> int:
        return min((await healthy_counts(http, stack.admin_ports, clusters)).values())

    before = await lowest_count()
    stopped = api_process_pids(stack.pids["controller"]) or [stack.pids["controller"]]
    reregistered = fleet_.counters.reregistered
    lowest, back = before, None
    started = time.monotonic()
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        while time.monotonic() - started < stall_s:
            lowest = min(lowest, await lowest_count())
            await asyncio.sleep(0.05)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    while (elapsed := time.monotonic() - started) < stall_s + timeout_s:
        count = await lowest_count()
        lowest = min(lowest, count)
        if count >= before:
            back = elapsed
            break
        await asyncio.sleep(0.05)
    return {"stall_lowest_share": lowest / before if before else float("nan"), "stall_back_s": back,
            "stall_reregistered": fleet_.counters.reregistered - reregistered}


async def silence(http: aiohttp.ClientSession, stack: Stack, fleet_: Fleet, clusters: Sequence[str],
                  workers: Sequence[Worker], at_most: int, timeout_s: float) -> dict[str, Any]:
    """``workers`` stop heartbeating (their servers still answer every probe, so only their TTL can take them
    out); seconds until every Envoy lists at most ``at_most`` healthy in ``clusters``."""
    fleet_.silent.update(worker.id for worker in workers)
    out = await wait_counts(http, stack.admin_ports, clusters, lambda c: c <= at_most, timeout_s, poll_s=0.05)
    return {"silent_out_s": out}


async def wait_counts(http: aiohttp.ClientSession, admin_ports: Mapping[str, int], clusters: Sequence[str], done: Any,
                      timeout_s: float, poll_s: float = 0.01) -> float | None:
    """Seconds until ``done(count)`` holds in every Envoy (each Envoy's own first time; the max), or None.
    Each Envoy is polled on its own, all at once: asked one after the other, each Envoy's answer waited
    for the others' (a few ms each at 200 pools on a busy host), which the latency measured then held."""
    started = time.monotonic()

    async def reached(port: int) -> float | None:
        while time.monotonic() - started < timeout_s:
            if done(await envoy_healthy(http, f"http://127.0.0.1:{port}", clusters)):
                return time.monotonic() - started
            await asyncio.sleep(poll_s)
        return None

    times = await asyncio.gather(*(reached(port) for port in admin_ports.values()))
    return None if any(t is None for t in times) else max(t for t in times if t is not None)


def registration(worker: Worker) -> dict[str, Any]:
    return {"id": worker.id, "pool": worker.pool, "host": worker.host, "port": worker.port,
            "node": f"bench-node-{worker.id[0]}{int(worker.id[1:]) // 8}"}


class Fleet:
    """Registers the fake workers and keeps them heartbeating through the API."""

    def __init__(self, http: aiohttp.ClientSession, api: str, workers: Sequence[Worker], interval_s: float,
                 node_batch: int) -> None:
        self._http = http
        self._api = api
        url = urllib.parse.urlsplit(api)
        self.address = (url.hostname or "127.0.0.1", url.port or 80, False)
        self._clients: list[LeanHttpClient] = []
        self.workers = workers
        self.interval_s = interval_s
        self._node_batch = node_batch
        self.node_batch = node_batch
        self.counters = Counters()
        self._registering: dict[str, asyncio.Task[None]] = {}
        """Workers of a node being registered again after their node's heartbeat named them expired."""
        self.registered: set[str] = set()
        """Workers whose first registration went through: only they heartbeat (a worker beats once it
        has registered)."""
        self.silent: set[str] = set()
        """Workers that stopped heartbeating (``silence``)."""

    async def register(self, worker: Worker) -> float:
        """One registration: 0 once it went through, else how long to wait before the next try (the API's
        ``Retry-After`` when it puts the registration off, counted apart; 0.1 s after an error, counted)."""
        try:
            async with self._http.post(f"{self._api}/v1/workers", json=registration(worker)) as r:
                await r.read()
                if r.status == 201:
                    self.registered.add(worker.id)
                    return 0.0
                if r.status == 503 and "Retry-After" in r.headers:
                    self.counters.registrations_deferred += 1
                    return float(r.headers["Retry-After"])
        except (aiohttp.ClientError, TimeoutError):
            pass
        self.counters.registration_errors += 1
        return 0.1

    async def register_until_done(self, worker: Worker) -> None:
        while True:
            delay = await self.register(worker)
            if not delay:
                return
            await asyncio.sleep(delay)

    async def register_all(self, concurrency: int) -> float:
        """Register everyone with ``concurrency`` clients; returns registrations per second."""
        queue = list(self.workers)
        started = time.monotonic()

        async def client() -> None:
            while queue:
                worker = queue.pop()
                if delay := await self.register(worker):
                    queue.insert(0, worker)  # a worker retries later, as the API asks it to
                    await asyncio.sleep(delay)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return len(self.workers) / (time.monotonic() - started)

    def counted(self, group: Sequence[Worker], sent: float, outcome: tuple[int, bytes] | BaseException) -> float:
        """A heartbeat call's answer for ``group`` (a node's workers, or one worker's own call), counted; a worker
        the API no longer knows registers again, beside the heartbeats, as a node agent would (its node's other
        workers keep beating meanwhile). Returns the interval until the group's next call: the one the answer
        named, or the last one named when it named none (a failed call is asked again at the same pace)."""
        if isinstance(outcome, BaseException) or (outcome[0] != 200 and (self._node_batch > 0 or outcome[0] != 404)):
            self.counters.failed += len(group)
            return self.interval_s
        self.counters.latencies.append(time.monotonic() - sent)
        status, answer = outcome
        named = orjson.loads(answer) if status == 200 else {}
        interval_s = float(named.get("heartbeat_interval_s") or self.interval_s)
        self.counters.intervals.append(interval_s)
        if self._node_batch <= 0:
            missing = {group[0].id} if status == 404 else set()
        else:
            missing = set(named.get("not_registered", ()))
        self.counters.ok += len(group) - len(missing)
        self.counters.expired += len(missing)
        for worker in group:
            if worker.id in missing and worker.id not in self._registering:
                self.counters.reregistered += 1
                self._registering[worker.id] = asyncio.create_task(self._register_again(worker))
        return interval_s

    async def _register_again(self, worker: Worker) -> None:
        try:
            await self.register_until_done(worker)
        finally:
            del self._registering[worker.id]

    async def run(self) -> None:
        """Heartbeat every node (``--node-batch``; or every worker) every interval, each at its own random phase,
        until cancelled. The fleet's agents run on machines of their own; here one process plays 1,250 of them at
        10,000 workers, so each beat costs as little as it can: sent from a coarse timer's callback on the node's
        kept-alive connection, its request encoded once (again when its registered workers change), its answer
        counted in the callback that parsed it, with no coroutine or loop timer per beat (with a coroutine each,
        this process took 0.3-0.4 of a core of the two it shared with the stack it measured)."""
        size = self._node_batch if self._node_batch > 0 else 1
        beats = [_Beats(self, self.workers[i:i + size], self.own_client()) for i in range(0, len(self.workers), size)]
        loop = asyncio.get_running_loop()
        for beat in beats:
            beat.start(loop.time() + random.uniform(0, self.interval_s))
        try:
            await loop.create_future()  # until cancelled
        finally:
            for beat in beats:
                beat.stop()
            pending = list(self._registering.values())
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for client in self._clients:
                client.close()

    def own_client(self) -> LeanHttpClient:
        """A node's (or worker's) own connection to the API, as real node agents each have."""
        client = LeanHttpClient(headers=b"Authorization: Bearer %s\r\n" % TOKEN.encode())
        self._clients.append(client)
        return client

    def beat_request(self, group: Sequence[Worker]) -> tuple[bytes, bytes]:
        """(path, body) of the heartbeat call for ``group``'s registered workers: a node's batch, or a worker's own
        routine beat (no state: a worker reports a change in a call of its own, ``observe_changes``)."""
        if self._node_batch > 0:
            return b"/v1/heartbeats", orjson.dumps({"workers": [{"id": w.id} for w in group]})
        return b"/v1/workers/%s/heartbeat" % group[0].id.encode(), b"{}"


class _Beats:
    """One node's (or worker's) heartbeats (``Fleet.run``)."""

    def __init__(self, fleet_: Fleet, group: Sequence[Worker], client: LeanHttpClient) -> None:
        self._fleet = fleet_
        self._group = group
        self._client = client
        self._timers = coarse_timers()
        self._timer: CoarseTimer | None = None
        self._request: tuple[int, bytes, bytes] = (0, b"", b"")
        """(registered workers it was encoded for, path, body)."""
        self._tasks: set[asyncio.Task[tuple[int, bytes]]] = set()
        self._stopped = False
        self._interval_s = fleet_.interval_s
        """The interval the registry named last (the configured one until it names one)."""

    def start(self, at: float) -> None:
        if not self._stopped:
            self._timer = self._timers.call_at(at, self._beat)

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        for task in self._tasks:
            task.cancel()

    def _beat(self) -> None:
        started = asyncio.get_running_loop().time()
        group = [w for w in self._group if w.id in self._fleet.registered and w.id not in self._fleet.silent]
        if not group:
            self.start(started + self._interval_s)
            return
        if self._request[0] != len(group):  # (registered workers join; silenced ones leave once, at the end)
            self._request = (len(group), *self._fleet.beat_request(group))
        self._send(group, started, time.monotonic(), kept=True)

    def _send(self, group: Sequence[Worker], started: float, sent: float, kept: bool) -> None:
        """The call on the node's kept-alive connection (``kept``), or else on a new one, in a task (the first
        beat, or the API closed the connection)."""
        _, path, body = self._request
        answered = functools.partial(self._answered, group, started, sent)
        deadline = started + HEARTBEAT_TIMEOUT_S
        if kept and self._client.ask_kept(b"POST", self._fleet.address, path, deadline, answered, body=body):
            return
        task = asyncio.get_running_loop().create_task(
            self._client.request(b"POST", self._fleet.address, path, body, deadline=deadline))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._asked_in_task, answered))

    def _asked_in_task(self, answered: Callable[[tuple[int, bytes] | BaseException], None],
                       task: asyncio.Task[tuple[int, bytes]]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            error = task.exception()
            answered(error if error is not None else task.result())

    def _answered(self, group: Sequence[Worker], started: float, sent: float,
                  outcome: tuple[int, bytes] | BaseException) -> None:
        if self._stopped:
            return
        if isinstance(outcome, PeerClosed):  # the API closed the kept connection as it was asked: ask on a new one
            self._send(group, started, sent, kept=False)
            return
        self._interval_s = self._fleet.counted(group, sent, outcome)
        self.start(max(started + self._interval_s, asyncio.get_running_loop().time()))


def rss_mib(pid: int) -> float:
    """Resident memory; NaN for a process that died."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def redis_commands(port: int) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"INFO stats\r\n")
    await writer.drain()
    text = b""
    while b"total_commands_processed" not in text or not text.endswith(b"\r\n\r\n"):
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        if not chunk:
            break
        text += chunk
    writer.close()
    return int(re.search(rb"total_commands_processed:(\d+)", text).group(1))  # type: ignore[union-attr]


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    """One unlabelled metric of the Prometheus page at ``url``; NaN when the process does not answer (it died:
    the row says so) or has no such metric."""
    try:
        async with http.get(url) as r:
            text = await r.text()
    except aiohttp.ClientError:
        return float("nan")
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def quantile(values: Sequence[float], share: float) -> float:
    """The nearest-rank percentile every benchmark reports, over the values that were measured (NaN: not)."""
    return percentile([v for v in values if v == v], share)


async def steady(http: aiohttp.ClientSession, stack: Stack, fleet_: Fleet, seconds: float) -> dict[str, Any]:
    """CPU share and RSS per process, Redis commands/s, heartbeat success and snapshot age over ``seconds``."""
    api = {f"controller_api{i}": pid for i, pid in enumerate(api_process_pids(stack.pids["controller"]))}
    pids = {**stack.pids, **api, "load": os.getpid()}
    before_cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
    host_before = cpu_times()
    before_ops = await redis_commands(stack.redis_port)
    counters_before = Counters(**{k: v for k, v in vars(fleet_.counters).items()
                                  if k not in ("latencies", "intervals")})
    fleet_.counters.latencies.clear()
    fleet_.counters.intervals.clear()
    started = time.monotonic()
    ages: list[float] = []
    lags: list[float] = []
    lagging = asyncio.create_task(loop_lag(lags))
    while time.monotonic() - started < seconds:
        ages.append(await metric(http, stack.extproc_metrics, "poolgate_extproc_snapshot_age_seconds"))
        await asyncio.sleep(0.1)
    wall = time.monotonic() - started
    lagging.cancel()
    ops = await redis_commands(stack.redis_port) - before_ops
    round_s = await metric(http, f"{stack.api}/metrics", "poolgate_health_round_seconds")
    now = fleet_.counters
    delta = Counters(now.ok - counters_before.ok, now.expired - counters_before.expired,
                     now.failed - counters_before.failed, now.reregistered - counters_before.reregistered)
    await asyncio.sleep(0)
    row: dict[str, Any] = {"heartbeat_success": delta.success, "reregistrations": delta.reregistered,
                           "registration_errors": now.registration_errors,
                           "registrations_deferred": now.registrations_deferred,
                           "heartbeat_p50_s": quantile(now.latencies, 0.5),
                           "heartbeat_p99_s": quantile(now.latencies, 0.99),
                           "heartbeat_interval_p50_s": quantile(now.intervals, 0.5),
                           "heartbeats_s": (delta.ok + delta.expired + delta.failed) / wall / max(1, fleet_.node_batch),
                           "redis_ops_s": ops / wall, "snapshot_age_p50_s": quantile(ages, 0.5),
                           "snapshot_age_p99_s": quantile(ages, 0.99),
                           "extproc_answered": sum(1 for a in ages if a == a) / max(1, len(ages)),
                           "load_loop_lag_p50_s": quantile(lags, 0.5), "load_loop_lag_p99_s": quantile(lags, 0.99),
                           "health_round_s": round_s}
    for name, pid in pids.items():
        try:
            row[f"cpu_{name}"] = (cpu_seconds(pid) - before_cpu[name]) / wall
        except OSError:
            row[f"cpu_{name}"] = float("nan")
        row[f"rss_mib_{name}"] = rss_mib(pid)
    row["cpu_controller_api"] = sum(row[f"cpu_{name}"] for name in api)
    host_after = cpu_times()
    row["cpu_host"] = (host_after[0] - host_before[0]) / (host_after[1] - host_before[1]) * (os.cpu_count() or 1)
    return row


async def loop_lag(lags: list[float], every_s: float = 0.01) -> None:
    """How late this process's loop wakes a sleeper, every ``every_s``, into ``lags`` (until cancelled): a
    measurement on this loop waits that long behind the fleet's heartbeats."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        lags.append(loop.time() - due)


def api_process_pids(controller: int) -> list[int]:
    """The controller's API processes (``controller.api_processes`` above 1)."""
    children = Path(f"/proc/{controller}/task/{controller}/children").read_text().split()
    return [int(pid) for pid in children if b"controller.api_processes" in Path(f"/proc/{pid}/cmdline").read_bytes()]


async def one_changes(stack: Stack, fleet_: Fleet, changes: int, interval_s: float,
                      shards: int) -> dict[str, Any]:
    """A worker reports Draining (the healthy count drops by one), then Ready again (it comes back), ``changes``
    times, each measured by ``observe_changes`` in a process of its own (``in_observer``)."""
    picked = [fleet_.workers[-1 - index % max(1, len(fleet_.workers) // 2)] for index in range(changes)]
    return await in_observer({"phase": "changes", "admin_ports": stack.admin_ports, "api": stack.api,
                              "interval_s": interval_s,
                              "workers": [(w.id, worker_cluster(w.pool, w.id, shards)) for w in picked]})


async def in_observer(spec: dict[str, Any]) -> Any:
    """What ``observe`` measured for ``spec``, in a process of its own. This process plays the fleet's heartbeats
    (2,500 calls a second at 10,000 workers): a call timed on its loop, or an Envoy polled from it, waits behind
    them (``load_loop_lag_p99_s``: 10-22 ms at 10,000 workers), and a real worker's call and Envoy do not."""
    observer = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.scale", "observe", json.dumps(spec),
                                                    stdout=asyncio.subprocess.PIPE,
                                                    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    out, _ = await observer.communicate()
    if observer.returncode:
        raise RuntimeError(f"the observer of {spec['phase']} exited with {observer.returncode}")
    return json.loads(out.splitlines()[-1])


async def observe(spec: dict[str, Any]) -> Any:
    """The observer's side (``in_observer``): the one-change phase, or a mass failure: stop the process that
    serves the failing workers and wait until every Envoy lists at most ``at_most`` healthy."""
    async with aiohttp.ClientSession() as http:
        if spec["phase"] == "changes":
            return await observe_changes(http, spec["admin_ports"], spec["api"], spec["workers"], spec["interval_s"])
        os.kill(spec["stop_pid"], spec["signal"])
        return await wait_counts(http, spec["admin_ports"], spec["clusters"], lambda c: c <= spec["at_most"],
                                 timeout_s=spec["timeout_s"], poll_s=0.05)


async def observe_changes(http: aiohttp.ClientSession, admin_ports: Mapping[str, int], api: str,
                          workers: Sequence[tuple[str, str]], interval_s: float) -> dict[str, Any]:
    """Each of ``workers`` (id, its cluster) reports Draining then Ready, at once, in a call of its own, as a worker
    does when it happens (beside its node's batches, which carry no state, as poolgate's agent sends them).

    A latency counts from the call until the last Envoy applied the update that shows the change (its stamp; NaN:
    not shown within 5 s); ``polled`` until the poll saw it there; ``answered`` until the API answered the call (the
    change is in Redis then): what is left is the controller's and Envoy's part."""
    url = urllib.parse.urlsplit(api)
    address = (url.hostname or "127.0.0.1", url.port or 80, False)
    client = LeanHttpClient(headers=b"Authorization: Bearer %s\r\n" % TOKEN.encode())
    latencies, polled, answered, refused = [], [], [], 0
    try:
        # a worker's connection to the API is open before its change (it heartbeats), and so is this one's
        await client.request(b"POST", address, b"/v1/workers/%s/heartbeat" % workers[0][0].encode(), b"{}")
        for worker_id, cluster in workers:
            for state, step in (("Draining", -1), ("Ready", 1)):
                start = min((await healthy_counts(http, admin_ports, [cluster])).values())
                sent, sent_wall = time.monotonic(), time.time()
                status, _ = await client.request(b"POST", address, b"/v1/workers/%s/heartbeat" % worker_id.encode(),
                                                 orjson.dumps({"state": state}),
                                                 deadline=asyncio.get_running_loop().time() + HEARTBEAT_TIMEOUT_S)
                answered.append(time.monotonic() - sent)
                refused += status != 200
                shown = await asyncio.gather(*(shown_in(http, f"http://127.0.0.1:{port}", cluster, start + step, sent,
                                                        sent_wall) for port in admin_ports.values()))
                latencies.append(slowest(applied for _, applied in shown))
                polled.append(slowest(seen for seen, _ in shown))
            await asyncio.sleep(interval_s)
    finally:
        client.close()
    return {"latencies": latencies, "polled": polled, "answered": answered, "refused": refused}


def slowest(times: Iterable[float]) -> float:
    """The largest of ``times``; NaN when one is NaN (not shown)."""
    values = list(times)
    return float("nan") if any(math.isnan(t) for t in values) else max(values)


async def shown_in(http: aiohttp.ClientSession, admin: str, cluster: str, expected: int, sent: float,
                   sent_wall: float) -> tuple[float, float]:
    """Once the Envoy at ``admin`` lists ``expected`` healthy in ``cluster`` (polled every ``CHANGE_POLL_S``): how long
    after ``sent`` (monotonic; ``sent_wall`` on the wall clock) the poll saw it, and Envoy applied the update that
    showed it (its ``update_time``: its clock reads ms, so up to 1 ms early; a later update of the cluster before the
    poll only makes it later; the poll's time where the stamp is missing or older than the call). NaN for both when
    it was not shown within 5 s."""
    while time.monotonic() - sent < 5:
        count, applied = await envoy_cluster(http, admin, cluster)
        if count == expected:
            seen = time.monotonic() - sent
            return seen, applied - sent_wall if applied >= sent_wall - 0.001 else seen
        await asyncio.sleep(CHANGE_POLL_S)
    return float("nan"), float("nan")


async def measure(n: int, pools: int, node_batch: int, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="poolgate-scale-"))
    group = ProcessGroup(run_dir)
    fail = min(args.fail, n)
    alive_port, doomed_port, sick_port = free_port(), free_port(), free_port()
    shards = args.endpoint_shards or auto_shards(-(-n // pools))
    measured = clusters_of(pool_names(pools), shards)
    row: dict[str, Any] = {"workers": n, "pools": pools, "endpoint_shards": shards, "node_batch": node_batch,
                           "heartbeat_interval_s": args.heartbeat_interval_s or 0.5, "sick": args.sick,
                           "fail_mode": args.fail_mode}
    try:
        config_path = write_config(run_dir, pools, args.heartbeat_interval_s, args.api_processes, args.sick > 0,
                                   shards)
        interval_s = yaml.safe_load(config_path.read_text()).get("controller", {}).get("heartbeat_interval_s", 0.5)
        # The fake workers stand for machines of their own: on this host they yield the CPU to the stack.
        fake_workers = {name: group.start(name, ["nice", "-n", str(FAKE_WORKERS_NICE), sys.executable, "-m",
                                                 "bench.scale", "serve-workers", str(port),
                                                 *(["fail-requests"] if name == "fake_workers_sick" else [])],
                                          env={"PYTHONPATH": str(REPO_ROOT)}).pid
                        for name, port in (("fake_workers", alive_port), ("fake_workers_doomed", doomed_port),
                                           ("fake_workers_sick", sick_port))}
        stack = await start_stack(run_dir, config_path, group)
        stack.pids.update(fake_workers)  # the harness's own CPU, reported beside the stack's
        # No cap on connections: every node (or worker) heartbeats over its own, as real ones do; a shared
        # pool would queue the fleet's heartbeats in this process and expire workers the API answered in time.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, headers={"Authorization": f"Bearer {TOKEN}"},
                                         timeout=aiohttp.ClientTimeout(total=30)) as http:
            # the sick pool first: the one-change phase takes its workers from the end
            fleet_ = Fleet(http, stack.api, sick_pool(args.sick, alive_port, sick_port)
                           + fleet(n, pools, fail, alive_port, doomed_port), interval_s, node_batch)
            beating = asyncio.create_task(fleet_.run())
            await asyncio.sleep(0)
            row["registrations_s"] = await fleet_.register_all(args.concurrency)
            reached = await wait_counts(http, stack.admin_ports, measured, lambda c: c >= n,
                                        timeout_s=args.timeout_s, poll_s=0.05)
            row["all_in_envoy_s"] = reached
            if reached is None:
                row["healthy_seen"] = await healthy_counts(http, stack.admin_ports, measured)
            row.update(await steady(http, stack, fleet_, args.steady_s))
            if reached is not None:
                changes = await one_changes(stack, fleet_, args.changes, interval_s, shards)
                latencies, answered = changes["latencies"], changes["answered"]
                row["change_refused"] = changes["refused"]
                row["change_p50_s"] = quantile(latencies, 0.5)
                row["change_p99_s"] = quantile(latencies, 0.99)
                row["change_in_redis_p50_s"] = quantile(answered, 0.5)
                row["change_in_redis_p99_s"] = quantile(answered, 0.99)
                row["change_latencies_ms"] = [round(x * 1000, 1) for x in latencies]
                row["change_in_redis_ms"] = [round(x * 1000, 1) for x in answered]
                row["change_polled_p50_s"] = quantile(changes["polled"], 0.5)
                row["change_polled_p99_s"] = quantile(changes["polled"], 0.99)
                row["change_polled_ms"] = [round(x * 1000, 1) for x in changes["polled"]]
                if args.sick and await wait_counts(http, stack.admin_ports, [cluster_name(SICK_POOL)],
                                                   lambda c: c >= 2 * args.sick, args.timeout_s) is not None:
                    row.update(await sick_ejection(http, stack, args.sick, args.timeout_s))
                silent: list[Worker] = []
                if args.silent > 0:  # before the stall: workers overdue within a TTL of a registry's return are held
                    everyone = fleet(n, pools, fail, alive_port, doomed_port)
                    # after the doomed ones where there is room (the changes took theirs from the end), else doomed
                    silent = (everyone[fail:fail + args.silent] if fail + args.silent <= n // 2
                              else everyone[:args.silent])
                    row.update(await silence(http, stack, fleet_, measured, silent, n - len(silent), args.timeout_s))
                silent_alive = sum(1 for worker in silent if worker.port == alive_port)
                if args.stall_api_s > 0:
                    row.update(await api_stall(http, stack, fleet_, measured, args.stall_api_s, args.timeout_s))
                early = await metric(http, f"{stack.api}/metrics", "poolgate_health_early_confirmations_total")
                row["ejection_s"] = await in_observer({
                    "phase": "ejection", "admin_ports": stack.admin_ports, "clusters": measured,
                    "at_most": n - fail - silent_alive,
                    "stop_pid": group.children["fake_workers_doomed"].pid, "timeout_s": args.timeout_s,
                    "signal": signal.SIGSTOP if args.fail_mode == "hang" else signal.SIGTERM})
                row["ejection_early_confirmations"] = (
                    await metric(http, f"{stack.api}/metrics", "poolgate_health_early_confirmations_total") - early)
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
    finally:
        group.stop_all()
    print(json.dumps(row), flush=True)
    return row


COLUMNS = [Column("workers", "workers", "{}"), Column("pools", "pools", "{}"),
           Column("node_batch", "per call (0: own)", "{}"),
           Column("registrations_s", "reg/s", "{:.0f}"), Column("heartbeat_success", "hb ok", "{:.4f}"),
           Column("heartbeat_interval_p50_s", "hb interval s", "{:.2f}"), Column("heartbeats_s", "calls/s", "{:.0f}"),
           Column("all_in_envoy_s", "all in Envoy s", "{:.2f}"), Column("change_p50_s", "change p50 s", "{:.3f}"),
           Column("change_p99_s", "change p99 s", "{:.3f}"), Column("change_polled_p99_s", "polled p99 s", "{:.3f}"),
           Column("change_in_redis_p99_s", "of which API p99 s", "{:.3f}"), Column("ejection_s", "eject s", "{:.2f}"),
           Column("health_round_s", "round s", "{:.2f}"), Column("silent_out_s", "silent out s", "{:.2f}"),
           Column("sick_out_s", "sick out s", "{:.2f}"), Column("sick_failed_requests", "sick failed", "{}"),
           Column("stall_lowest_share", "stall low", "{:.3f}"), Column("stall_back_s", "stall back s", "{:.2f}"),
           Column("stall_reregistered", "stall rereg", "{}"),
           Column("snapshot_age_p99_s", "snap age p99", "{:.3f}"), Column("redis_ops_s", "redis ops/s", "{:.0f}"),
           Column("cpu_controller", "ctl cpu", "{:.2f}"), Column("cpu_controller_api", "api procs cpu", "{:.2f}"),
           Column("cpu_redis", "redis cpu", "{:.2f}"),
           Column("cpu_extproc", "extproc cpu", "{:.2f}"), Column("cpu_envoy_a", "envoy cpu", "{:.2f}"),
           Column("rss_mib_controller", "ctl MiB", "{:.0f}"), Column("cpu_host", "host busy", "{:.2f}")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["observe"]:
        print(json.dumps(uvloop.run(observe(json.loads(argv[1])))), flush=True)
        return 0
    if argv[:1] == ["serve-workers"]:
        fake_workers.serve(int(argv[1]), [MODEL, SICK_MODEL], fail_requests=argv[2:3] == ["fail-requests"])
        return 0
    freeze_startup_objects()  # this process is the fleet's heartbeats: no collector pauses in them either
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1000])
    parser.add_argument("--pools", type=int, nargs="+", default=[1])
    parser.add_argument("--fail", type=int, default=1000, help="workers that stop answering at once")
    parser.add_argument("--fail-mode", choices=("exit", "hang"), default="exit",
                        help="their server exits (a crash) or is stopped (a hang)")
    parser.add_argument("--concurrency", type=int, default=64, help="registration clients at once")
    parser.add_argument("--node-batch", type=int, nargs="+", default=[0, 8],
                        help="heartbeat K workers per call (POST /v1/heartbeats); 0 = one call per worker, each on its "
                             "own connection (the default configuration); one row per value")
    parser.add_argument("--heartbeat-interval-s", type=float, default=None,
                        help="heartbeat every this many seconds (TTL three times that); default: the config's 0.5 s")
    parser.add_argument("--api-processes", type=int, default=0,
                        help="controller.api_processes (0: the config's default, one per core)")
    parser.add_argument("--silent", type=int, default=100,
                        help="workers that stop heartbeating but answer their probes (0: no TTL phase)")
    parser.add_argument("--sick", type=int, default=10,
                        help="workers that fail every request but pass their probes (0: no passive-ejection phase)")
    parser.add_argument("--endpoint-shards", type=int, default=0,
                        help="clusters per measured pool (PoolSpec.endpoint_shards); 0 = one per 1,000 workers of "
                             "a pool past 2,000, as the controller's warning asks")
    parser.add_argument("--stall-api-s", type=float, default=2.5,
                        help="stop the registry API this long, past the heartbeat TTL (0: no stall phase)")
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="give up waiting for Envoy after this")
    parser.add_argument("--name", default="scale", help="report name under bench/reports")
    args = parser.parse_args(argv)
    # Stopped from outside, stop the stack too: the exit cancels the run, whose cleanup stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # uvloop, as the controller has: this process plays the whole fleet and must not be what runs out of CPU
    with host_quiet.measure() as quiet:
        rows = [uvloop.run(measure(n, p, batch, args)) for p in args.pools for n in args.workers
                for batch in args.node_batch]
    save_rows(args.name, rows, COLUMNS, x_key="workers",
              panels=[Panel("time to Envoy", ("all_in_envoy_s", "change_p99_s", "ejection_s"), "s"),
                      Panel("CPU", ("cpu_controller", "cpu_redis", "cpu_extproc", "cpu_envoy_a"), "cores")],
              parameters={k: v for k, v in vars(args).items()}, host=quiet.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
