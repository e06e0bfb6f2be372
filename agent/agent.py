"""The agent loop: scrape this node's workers' ``/metrics`` and the GPUs each tick, write live facts to Redis.

Which workers are this node's: with a node name (``--node``; on Kubernetes the pod's ``spec.nodeName``), those
whose record names that node, at any address (pod IPs included); records without a node, and every record
when the agent has no node name, by address (a host name or address of this machine, or loopback). A list
of worker ids overrides both.

Each tick reads all workers concurrently, so one slow worker delays a tick by at most the scrape timeout.
A failed scrape writes nothing for that worker: stale facts must age out (``metrics_at``) rather than be
refreshed. The agent never changes a worker's state and never registers one; the controller does that.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from agent.gpu_sources.choose import open_gpu_source
from agent.gpu_sources.reading import NO_GPUS, GpuReading, GpuSource
from agent.gpus import GpuReader, open_gpus
from agent.live import live_fields, notable_change
from agent.podresources import POD_RESOURCES_SOCKET, PodKey, PodResourcesClient, PodResourcesError
from agent.rates import RateState, advance
from agent.vllm_metrics import EngineMetrics, parse_engine_metrics
from poolgate.kernel.config import Config, KubernetesSettings, WorkerSpec
from poolgate.kernel.errors import UpstreamError
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.fleet_view import FleetView
from poolgate.kernel.outage import REDIS_ERRORS, OutageLog
from poolgate.kernel.store import FleetStore
from poolgate.kernel.tls import ClientTls, worker_scheme

log = logging.getLogger("poolgate.agent")

FLEET_REFRESH_S = 2.0
"""How often the list of workers to scrape is brought up to date from Redis (workers come and go slowly)."""


class MetricsSource(Protocol):
    """Fetches one worker's ``/metrics`` page; raises on any failure (an ``UpstreamError`` for an answer
    that is not the page, such as ``ScrapeError``)."""

    async def fetch(self, host: str, port: int) -> str: ...


class HttpMetricsSource:
    """``GET http://host:port/metrics`` over one shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float, scheme: str = "http") -> None:
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._scheme = scheme

    async def fetch(self, host: str, port: int) -> str:
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        async with self._session.get(f"{self._scheme}://{netloc}/metrics", timeout=self._timeout) as response:
            if response.status != 200:
                raise ScrapeError(f"/metrics answered HTTP {response.status}")
            return await response.text()


class PodGpuSource(Protocol):
    """GPU ids (UUIDs) held by each pod of this node (the kubelet's PodResources API in production); raises
    ``PodResourcesError`` when they cannot be read."""

    async def pod_gpus(self) -> Mapping[PodKey, Sequence[str]]: ...


class ScrapeError(UpstreamError):
    """A worker's metrics could not be read or understood."""


@dataclass
class AgentStats:
    """Counters for logs and tests; degraded operation shows here first."""

    ticks: int = 0
    scrapes: int = 0
    scrape_failures: int = 0
    writes: int = 0
    write_failures: int = 0
    announcements: int = 0
    fleet_read_failures: int = 0
    pod_gpu_read_failures: int = 0


@dataclass
class _Tracked:
    record: WorkerRecord
    rates: RateState = field(default_factory=RateState)
    announced: dict[str, Any] | None = None
    consecutive_failures: int = 0


def local_host_names() -> frozenset[str]:
    """Names this node's workers may be registered under (loopback is recognised separately)."""
    names = {"localhost", "0.0.0.0", "::", socket.gethostname(), socket.getfqdn()}
    with contextlib.suppress(OSError):
        names.update(str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None))
    return frozenset(str(name) for name in names)


def is_local(host: str, local_names: Collection[str]) -> bool:
    if host in local_names:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def configured_gpu_ids(workers: Sequence[WorkerSpec],
                       extra: Mapping[str, Sequence[int | str]] | None = None) -> dict[str, tuple[int | str, ...]]:
    """GPU ids per worker: the config's ``workers[].gpus``, with ``extra`` added or overriding."""
    ids: dict[str, tuple[int | str, ...]] = {spec.id: spec.gpus for spec in workers if spec.gpus}
    ids.update({worker_id: tuple(gpus) for worker_id, gpus in (extra or {}).items()})
    return ids


class Agent:
    """One node's agent. ``tick`` does one round; ``run_agent`` calls it on the configured period.

    GPU ids per worker: ``gpu_ids`` first; else, with ``pod_gpus``, the GPUs the worker's pod holds (pod
    name = worker id in ``pod_namespace``, the Kubernetes backend's namespace), re-read with the fleet;
    else the GPUs a dcgm-exporter reading labels with that pod (``agent.gpu_sources.reading``).
    """

    def __init__(
        self, store: FleetStore, source: MetricsSource,
        gpus: GpuSource | None = None, *, worker_ids: Collection[str] | None = None, node: str | None = None,
        local_names: Collection[str] = frozenset(), gpu_ids: Mapping[str, Sequence[int | str]] | None = None,
        pod_gpus: PodGpuSource | None = None, pod_namespace: str = KubernetesSettings().namespace,
        clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
        fleet_refresh_s: float = FLEET_REFRESH_S,
    ) -> None:
        self._store = store
        self._source = source
        self._gpus = gpus
        self._worker_ids = None if worker_ids is None else frozenset(worker_ids)
        self._node = node or None
        self._local_names = frozenset(local_names)
        self._gpu_ids = {worker_id: tuple(ids) for worker_id, ids in (gpu_ids or {}).items()}
        self._pod_gpu_source = pod_gpus
        self._pod_namespace = pod_namespace
        self._pod_gpus: dict[str, tuple[str, ...]] = {}
        """Worker id → GPU ids of its pod, from the last good read."""
        self._pod_resources = OutageLog(
            log, "cannot read which GPUs this node's pods hold (%s); GPU facts of worker pods are not refreshed "
            "until it answers", "pod GPU assignments readable again")
        self._clock = clock
        self._wall_clock = wall_clock
        self._fleet_refresh_s = fleet_refresh_s
        self._fleet = FleetView(store, live=False)
        """Who is registered (identity only: the agent writes the live facts, it need not read them back);
        re-read in full only on start and on gaps, so a large fleet costs a refresh its changes."""
        self._fleet_read_at: float | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._redis = OutageLog(log, "Redis unreachable (%s); live facts are not written until it is back",
                                "Redis reachable again; writing live facts")
        self.stats = AgentStats()

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self._tracked)

    async def tick(self) -> None:
        now = self._clock()
        if self._fleet_read_at is None or now - self._fleet_read_at >= self._fleet_refresh_s:
            await self._refresh_fleet(now)
        self.stats.ticks += 1
        if not self._tracked:
            return
        tracked = list(self._tracked.values())
        gpu_reading, scrapes = await asyncio.gather(self._read_gpus(), asyncio.gather(*map(self._scrape, tracked)))
        await asyncio.gather(*(self._write(t, metrics, at, gpu_reading)
                               for t, (metrics, at) in zip(tracked, scrapes, strict=True) if metrics is not None))

    async def _refresh_fleet(self, now: float) -> None:
        try:
            delta = await self._fleet.sync()
        except REDIS_ERRORS as exc:
            self.stats.fleet_read_failures += 1
            self._redis.down(exc)
            # With workers known, keep scraping them and retry later; with none, retry next tick.
            self._fleet_read_at = now if self._tracked else None
            return
        self._redis.up()
        self._fleet_read_at = now
        # only the workers that changed are looked at (at 10,000 workers a walk over all took the loop 10-20 ms
        # every refresh); a full read names every worker it found or no longer found
        records = self._fleet.records
        for worker_id in delta.changed:
            record = records.get(worker_id)
            if record is None or not self._wanted(record):
                self._tracked.pop(worker_id, None)
                continue
            known = self._tracked.get(worker_id)
            if known is None or known.record.address != record.address:
                self._tracked[worker_id] = _Tracked(record)  # new, or restarted elsewhere: fresh rates
            else:
                known.record = record
        if self._pod_gpu_source is not None and self._tracked:
            await self._refresh_pod_gpus()

    def _wanted(self, record: WorkerRecord) -> bool:
        if self._worker_ids is not None:
            return record.id in self._worker_ids
        if self._node is not None and record.node:
            return record.node == self._node
        return is_local(record.host, self._local_names)

    async def _refresh_pod_gpus(self) -> None:
        assert self._pod_gpu_source is not None
        try:
            by_pod = await self._pod_gpu_source.pod_gpus()
        except PodResourcesError as exc:
            self.stats.pod_gpu_read_failures += 1
            self._pod_resources.down(exc)
            return
        self._pod_resources.up()
        self._pod_gpus = {name: tuple(gpus) for (namespace, name), gpus in by_pod.items()
                          if namespace == self._pod_namespace}

    async def _read_gpus(self) -> GpuReading:
        return NO_GPUS if self._gpus is None else await self._gpus.read()

    def _gpu_ids_of(self, worker_id: str) -> tuple[int | str, ...]:
        return self._gpu_ids.get(worker_id) or self._pod_gpus.get(worker_id, ())

    async def _scrape(self, tracked: _Tracked) -> tuple[EngineMetrics | None, float]:
        record = tracked.record
        try:
            metrics = parse_engine_metrics(await self._source.fetch(record.host, record.port))
        except (aiohttp.ClientError, TimeoutError, OSError, UpstreamError) as exc:
            self.stats.scrape_failures += 1
            tracked.consecutive_failures += 1
            if tracked.consecutive_failures == 1:
                log.warning("cannot scrape worker %s at %s (%s); its live facts are not refreshed",
                            record.id, record.address, str(exc) or type(exc).__name__)
            return None, self._clock()
        self.stats.scrapes += 1
        if tracked.consecutive_failures:
            log.info("worker %s scraped again after %d failures", record.id, tracked.consecutive_failures)
            tracked.consecutive_failures = 0
        return metrics, self._clock()

    async def _write(self, tracked: _Tracked, metrics: EngineMetrics, scraped_at: float,
                     gpu_reading: GpuReading) -> None:
        worker_id = tracked.record.id
        tracked.rates = advance(tracked.rates, metrics, scraped_at)
        gpus = gpu_reading.summary_for(self._gpu_ids_of(worker_id), node=tracked.record.node,
                                       pod=(self._pod_namespace, worker_id))
        fields = live_fields(metrics, tracked.rates, gpus)
        announce = notable_change(tracked.announced, fields)
        try:
            alive = await self._store.update_live(worker_id, announce=announce, metrics_at=self._wall_clock(),
                                                  **fields)
        except REDIS_ERRORS as exc:
            self.stats.write_failures += 1
            self._redis.down(exc)
            return
        self._redis.up()
        if not alive:  # the registration expired; the controller re-registers and a fleet read finds it
            self._tracked.pop(worker_id, None)
            self._fleet_read_at = None
            return
        self.stats.writes += 1
        if announce:
            self.stats.announcements += 1
            tracked.announced = fields


async def run_agent(
    config: Config, store: FleetStore, stop: asyncio.Event | None = None, *,
    worker_ids: Collection[str] | None = None, node: str | None = None,
    gpu_ids: Mapping[str, Sequence[int | str]] | None = None, pod_resources_socket: str = POD_RESOURCES_SOCKET,
    source: MetricsSource | None = None, open_nvml: Callable[[str], GpuReader | None] = open_gpus,
    clock: Callable[[], float] = time.monotonic, ready: Callable[[Agent], None] | None = None,
) -> AgentStats:
    """Run the agent until ``stop`` is set (or the task is cancelled); returns its counters.

    ``worker_ids`` limits it to those workers (any host); otherwise it serves the workers registered on
    ``node`` (any address) and those registered without a node at an address of this machine. GPU ids per
    worker come from the config's ``workers[].gpus``; ``gpu_ids`` adds or overrides (e.g. parsed
    ``CUDA_VISIBLE_DEVICES``); with a node and the kubelet's PodResources socket present, the GPUs each worker
    pod holds fill in the rest. The controller runs it in-process over its own store; the store's Redis client
    is not closed here.
    """
    interval = config.agent.scrape_interval_s
    gpus = await open_gpu_source(config.agent, open_nvml)
    # All may block (host name lookup, file system): keep them off the event loop.
    local_names = await asyncio.to_thread(local_host_names)
    pod_gpus: PodResourcesClient | None = None
    if node:
        if await asyncio.to_thread(os.path.exists, pod_resources_socket):
            pod_gpus = PodResourcesClient(pod_resources_socket)
            log.info("node %s: GPUs of worker pods from the kubelet at %s", node, pod_resources_socket)
        else:
            log.info("node %s: no kubelet PodResources socket at %s; GPU facts only for workers with "
                     "configured GPU ids", node, pod_resources_socket)
    session: aiohttp.ClientSession | None = None
    tls_watch: asyncio.Task[None] | None = None
    if source is None:
        tls = config.tls.workers
        worker_tls = ClientTls(tls, "tls.workers") if tls is not None else None
        if worker_tls is not None:  # its client certificate rotates without a restart
            tls_watch = asyncio.create_task(worker_tls.watch(config.tls.reload_s))
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            ssl=worker_tls.context if worker_tls is not None else True))
        # A scrape may outlast one tick a little (busy Python server), never by seconds.
        source = HttpMetricsSource(session, timeout_s=max(0.2, min(2 * interval, 2.0)), scheme=worker_scheme(tls))
    agent = Agent(store, source, gpus, worker_ids=worker_ids, node=node, local_names=local_names,
                  gpu_ids=configured_gpu_ids(config.workers, gpu_ids), pod_gpus=pod_gpus,
                  pod_namespace=config.kubernetes.namespace, clock=clock)
    stop = stop or asyncio.Event()
    if ready is not None:
        ready(agent)
    try:
        next_tick = clock()
        while not stop.is_set():
            await agent.tick()
            next_tick = max(next_tick + interval, clock())  # after an overrun, skip rather than burst
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, next_tick - clock()))
    finally:
        if tls_watch is not None:
            tls_watch.cancel()
        if session is not None:
            await session.close()
        if pod_gpus is not None:
            await pod_gpus.close()
        if gpus is not None:
            await gpus.close()
    return agent.stats
