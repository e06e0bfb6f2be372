"""``poolgate controller``: wires the registry API, the Redis → xDS bridge, the xDS server (with the access log
service Envoy reports failed upstream attempts to), the workers' backend, the in-process agent, the health
monitor, the drainer, the adapter loader, the autoscaler and the leader lease, each over the one
``FleetStore`` and the config section it reads.

Every controller serves xDS (``controller.xds_bridge``), the same resources at the same versions (both
are built from Redis), so an Envoy may hold its ADS stream to any of them; only the lease holder runs the
config's workers, probes, drains, replaces and scales. A controller that takes the lease over starts the
config's workers and finishes the drains the old leader left (``InstanceController.resume_drains``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import ssl
import sys
import tempfile
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry

from agent.agent import run_agent
from agent.gpus import open_gpus
from controller.adapters import AdapterLoader, run_adapter_loader
from controller.api_processes import ApiProcesses
from controller.api_processes import command as api_process_command
from controller.autoscaler import Autoscaler, run_autoscaler
from controller.backend import InstanceBackend
from controller.drain import Drainer
from controller.instances import InstanceController
from controller.lease import LeaderLease
from controller.local_backend import GpuFacts, LocalProcessBackend, worker_command
from controller.monitor import HealthMonitor, MonitorStats, RemedyElsewhere, run_monitor
from controller.monitor_metrics import MonitorMetrics
from controller.overload import LoopLag
from controller.own_loop import SWITCH_INTERVAL_S, CallOnLoop, run_on_own_loop
from controller.periodic import every
from controller.placement import GpuFree
from controller.probe import HttpProber
from controller.registry_api import RegistryApi
from controller.xds.metrics import XdsMetrics
from controller.xds.upstream_failures import UpstreamFailureLog
from controller.xds.xds_server import XdsServer
from controller.xds_bridge import bridge_fleet_to_xds
from poolgate.kernel.cancel import cancel_and_wait
from poolgate.kernel.config import Config, ConfigError, load_process_config
from poolgate.kernel.heap import freeze_startup_objects
from poolgate.kernel.logging_setup import add_log_format_argument, configure_logging
from poolgate.kernel.net import wait_port
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.shutdown import on_stop_signal
from poolgate.kernel.store import FleetStore, connect
from poolgate.kernel.tls import ClientTls, ServerTls, worker_scheme

if TYPE_CHECKING:
    from controller.kube_backend import KubernetesBackend

log = logging.getLogger("poolgate.controller")

STOP_DEADLINE_S = 20.0
"""Workers get 5 s to exit before they are killed; the rest (leases, xDS, Redis) takes well under a second."""
ADAPTER_LOAD_CONNECTIONS = 256
"""Connections the adapter loader may hold to workers at once (aiohttp's default, 100, queued a large fleet's)."""
API_READY_TIMEOUT_S = 30.0
"""How long the controller waits for its first API process to listen before it says it is ready."""


def node_gpus(nvml: str) -> GpuFacts | None:
    """This node's GPUs through NVML for placement (``agent.nvml``), or None without a driver."""
    reader = open_gpus(nvml)
    if reader is None:
        return None

    def read() -> Mapping[int, GpuFree]:
        return {i: GpuFree(i, s.memory_total_mib, s.memory_free_mib) for i, s in reader.read().items()}

    return read


async def sync_pods(kube: KubernetesBackend, interval_s: float, stop: asyncio.Event) -> None:
    """Keep the pool Deployments' Ready pods registered (they do not register themselves)."""
    # The API server or Redis away: keep trying; Envoy keeps its endpoints meanwhile.
    await every(interval_s, stop, kube.sync_registry, lambda exc: log.warning("kubernetes pod sync failed: %s", exc),
                errors=(Exception,))


async def _publish_api(store: FleetStore, api_url: str) -> None:
    with contextlib.suppress(*REDIS_ERRORS):
        await store.announce_controller(api_url)


async def _instance_backend(config: Config, store: FleetStore, log_dir: Path,
                            worker_tls: ssl.SSLContext | None) -> InstanceBackend:
    """Kubernetes Deployments when ``kubernetes.enabled``, else local processes on this machine."""
    if config.kubernetes.enabled:
        from controller.kube_backend import KubernetesBackend, api_client_from_environment

        api = await asyncio.to_thread(api_client_from_environment)
        return KubernetesBackend(config.kubernetes, config.pools, api, store, config.controller.heartbeat_ttl_s)
    gpus = await asyncio.to_thread(node_gpus, config.agent.nvml)
    return LocalProcessBackend(store, log_dir, functools.partial(worker_command, config), pools=config.pools,
                               workers=config.workers, settings=config.controller, placement=config.placement,
                               scaling=config.autoscale.pools, gpu_facts=gpus,
                               kv_events=config.extproc.kv_events.enabled, worker_tls=worker_tls)


@dataclass
class _ApiListeners:
    """Where the registry API listens: its runner, its base URL (with the bound port) and, with API processes
    (``shared``: the controller always runs them), the private loopback URL of the controller's own API that takes
    the operator calls they forward, and the socket that holds the public port for them."""

    runner: web.AppRunner
    url: str
    port: int
    private_url: str | None = None
    reservation: socket.socket | None = None

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.reservation is not None:
            self.reservation.close()


async def _serve_api(registry: RegistryApi, host: str, port: int, tls: ServerTls | None = None,
                     shared: bool = False) -> _ApiListeners:
    """The registry API listening (HTTPS with ``tls``). ``shared``: the API processes answer the public port
    and the controller listens on loopback only, so a heartbeat never waits behind the health monitor or
    an xDS build. The public port is bound here with ``SO_REUSEPORT`` but not listened on: the kernel hands
    connections only to listening sockets, and the port stays the fleet's while an API process restarts."""
    api = web.AppRunner(registry.app(), access_log=None)
    await api.setup()
    scheme = "https" if tls is not None else "http"
    if not shared:
        await web.TCPSite(api, host, port, ssl_context=tls.context if tls is not None else None).start()
        bound = api.addresses[0][1]
        return _ApiListeners(api, f"{scheme}://{host}:{bound}", bound)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    reservation = socket.socket(family, kind, proto)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reservation.bind(address)
    await web.TCPSite(api, "127.0.0.1", 0).start()
    bound = reservation.getsockname()[1]
    return _ApiListeners(api, f"{scheme}://{host}:{bound}", bound, f"http://127.0.0.1:{api.addresses[0][1]}",
                         reservation)


def _local_address(host: str) -> str:
    """Where this machine reaches a listener bound to ``host`` (a wildcard is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host


def _probe_session(config: Config, worker_tls: ssl.SSLContext | None) -> aiohttp.ClientSession:
    """Adapter loads sit under /v1, which a worker started with --api-key guards."""
    worker_key = config.worker_api_key()
    connector = aiohttp.TCPConnector(limit=ADAPTER_LOAD_CONNECTIONS, ssl=worker_tls or True)
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {worker_key}"} if worker_key else None,
                                 connector=connector)


def _health_monitor(config: Config, redis_url: str, instances: InstanceController,
                    worker_tls: ssl.SSLContext | None, metrics: CollectorRegistry,
                    is_leader: Callable[[], bool]) -> Callable[[asyncio.Event], Coroutine[object, object, None]]:
    """The health monitor as a duty for a loop of its own (``controller.own_loop``): its Redis client and
    prober are made on that loop, its remedies go to ``instances`` on this one, its counts to ``metrics``."""
    health = config.health
    stats = MonitorStats()
    MonitorMetrics(stats, metrics)
    remediate_here = CallOnLoop(asyncio.get_running_loop())

    async def duty(stop: asyncio.Event) -> None:
        redis = connect(redis_url)
        prober = HttpProber(health.probe_timeout_s, health.check_models, scheme=worker_scheme(config.tls.workers),
                            tls=worker_tls, api_key=config.worker_api_key())
        monitor = HealthMonitor(FleetStore(redis, config.key_prefix), health, config.extproc.stale_after_s, prober,
                                RemedyElsewhere(instances, remediate_here), is_leader=is_leader, stats=stats)
        try:
            await run_monitor(monitor, health.probe_interval_s, stop)
        finally:
            prober.close()
            await redis.aclose()

    return duty


def _fleet_tasks(config: Config, store: FleetStore, redis_url: str, instances: InstanceController,
                 probe_session: aiohttp.ClientSession, worker_tls: ssl.SSLContext | None, metrics: CollectorRegistry,
                 is_leader: Callable[[], bool], stop: asyncio.Event) -> list[asyncio.Task[object]]:
    """The loops that keep the fleet: the in-process agent, and (acting on the leader only) the health
    monitor (on a loop of its own), the adapter loader, the pod sync and the autoscaler."""
    scheme = worker_scheme(config.tls.workers)
    adapters = AdapterLoader(config.catalogue.adapters, store, probe_session, is_leader=is_leader, scheme=scheme)
    monitor = _health_monitor(config, redis_url, instances, worker_tls, metrics, is_leader)
    loops: list[Coroutine[object, object, object]] = [
        # The agent reads the local workers' /metrics and GPUs into Redis (one per node; here the node is us):
        # workers that name another node have that node's agent, even at an address that looks local.
        run_agent(config, store, node=socket.gethostname()),
        run_on_own_loop("health-monitor", monitor, stop),
        run_adapter_loader(adapters, config.catalogue.adapter_sync_s, stop),
    ]
    if config.kubernetes.enabled:
        from controller.kube_backend import KubernetesBackend

        assert isinstance(instances.backend, KubernetesBackend)
        loops.append(sync_pods(instances.backend, config.controller.heartbeat_interval_s, stop))
    if config.autoscale.enabled and config.autoscale.pools:
        autoscaler = Autoscaler(store, config.autoscale, instances, metrics, is_leader=is_leader)
        loops.append(run_autoscaler(autoscaler, config.autoscale.interval_s, stop))
    return [asyncio.create_task(loop) for loop in loops]


async def run_controller(config: Config, redis_url: str, *, host: str, xds_port: int, http_port: int,
                         token: str, log_dir: Path, config_path: str, start_workers: bool = True,
                         log_format: str = "text") -> None:
    """``config_path`` (the file ``config`` came from) and ``log_format`` are handed to API processes."""
    redis = connect(redis_url)
    store = FleetStore(redis, config.key_prefix)
    stop = asyncio.Event()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the health monitor runs in a thread beside this loop
    lease = LeaderLease(store, f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}",
                        config.autoscale.lease_ttl_s)
    xds = XdsServer(config.pools, config.tls)
    upstream_failures = UpstreamFailureLog(store, xds.worker_at)
    bound_xds = await xds.start(host, xds_port, config.tls.xds, services=[upstream_failures])
    api_tls = ServerTls(config.tls.registry_api, "tls.registry_api") if config.tls.registry_api else None
    # One client context for every call to workers (registration checks, probes, adapter loads), re-read
    # when its files rotate; the agent keeps its own.
    worker_tls = ClientTls(config.tls.workers, "tls.workers") if config.tls.workers else None
    backend = await _instance_backend(config, store, log_dir, worker_tls.context if worker_tls else None)
    local = backend if isinstance(backend, LocalProcessBackend) else None
    drainer = Drainer(store, config.drain)
    instances = InstanceController(store, backend, drainer, is_leader=lease.is_leader)
    metrics = CollectorRegistry()
    XdsMetrics(xds, metrics)
    lag = LoopLag()
    registry = RegistryApi(store, token, config.pools, config.controller, config.autoscale.pools, instances, metrics,
                           lag)
    # The workers' calls go to API processes only (one per core by default): the controller's loop, which
    # serves xDS and the health monitor, never answers a heartbeat.
    api_processes = config.controller.api_process_count()
    api = await _serve_api(registry, host, http_port, api_tls, shared=True)
    api_url = api.url
    serving_api: list[asyncio.Task[object]] = []
    if api.private_url is not None:
        command = api_process_command(config_path, log_format, host, api.port, api.private_url)
        serving_api.append(asyncio.create_task(ApiProcesses(api_processes, command, redis_url).run(stop)))
        if not await wait_port(_local_address(host), api.port, API_READY_TIMEOUT_S):
            log.warning("no API process listens on port %d after %.0f s; starting anyway", api.port,
                        API_READY_TIMEOUT_S)
    await lease.renew()
    # The config's workers run on the leader only (a standby starting them too would run each twice);
    # a standby starts them when it takes the lease over.
    if local is not None:
        await local.start_all(configured=start_workers and lease.is_leader())
    freeze_startup_objects()
    print(f"controller ready: api {api_url} xds {host}:{bound_xds} "
          f"workers {len(config.workers) if start_workers and local and lease.is_leader() else 0}", flush=True)
    announcements: set[asyncio.Task[object]] = set()

    async def take_over() -> None:
        await _publish_api(store, api_url)  # operator commands (`poolgate drain`, `poolgate scale`) find it
        if local is not None and start_workers:
            local.start_configured()
        with contextlib.suppress(*REDIS_ERRORS):
            resumed = await instances.resume_drains()
            if resumed:
                log.info("resumed the drains of %s", ", ".join(resumed))

    def on_gain() -> None:
        task: asyncio.Task[object] = asyncio.create_task(take_over())
        announcements.add(task)
        task.add_done_callback(announcements.discard)

    if lease.is_leader():
        on_gain()
    probe_session = _probe_session(config, worker_tls.context if worker_tls else None)
    tasks = [
        asyncio.create_task(bridge_fleet_to_xds(store, xds, empty_grace_s=2 * config.controller.heartbeat_ttl_s)),
        asyncio.create_task(lease.run(stop, on_gain=on_gain)),
        asyncio.create_task(lag.run()),
        *[asyncio.create_task(tls.watch(config.tls.reload_s, stop)) for tls in (api_tls, worker_tls) if tls],
        *_fleet_tasks(config, store, redis_url, instances, probe_session, worker_tls.context if worker_tls else None,
                     metrics, lease.is_leader, stop),
        *serving_api,
    ]
    on_stop_signal(asyncio.get_running_loop(), stop.set, STOP_DEADLINE_S)
    try:
        await stop.wait()
    finally:
        log.info("stopping: workers, API, xDS")
        stop.set()
        await cancel_and_wait(tasks)
        await drainer.close()
        if local is not None:
            await local.stop_all()
        await probe_session.close()
        with contextlib.suppress(Exception):
            await lease.release()
        await api.close()
        await xds.stop()
        await redis.aclose()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="poolgate YAML config")
    parser.add_argument("--redis-url", help="overrides the config's redis_url")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--xds-port", type=int, help="ADS port (default: config ports.xds)")
    parser.add_argument("--http-port", type=int, help="registry API port (default: config ports.controller_http)")
    parser.add_argument("--log-dir", help="where worker logs go (default: a temporary directory)")
    parser.add_argument("--no-workers", action="store_true", help="do not start the config's workers")
    add_log_format_argument(parser)


def main(args: argparse.Namespace) -> int:
    configure_logging(logging.INFO, getattr(args, "log_format", "text"))
    try:
        config, redis_url = load_process_config(args.config, args.redis_url, "controller")
        config.worker_api_key()  # named but unset: refuse now, not with every probe answered 401
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    token = config.controller.resolved_token()
    if not token:
        print(f"controller: no token (set {config.controller.token_env} or controller.token)", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="poolgate-workers-"))
    uvloop.run(run_controller(
        config, redis_url, host=args.host,
        xds_port=args.xds_port if args.xds_port is not None else config.ports.xds,
        http_port=args.http_port if args.http_port is not None else config.ports.controller_http,
        token=token, log_dir=log_dir, start_workers=not args.no_workers, config_path=args.config,
        log_format=getattr(args, "log_format", "text"),
    ))
    return 0
