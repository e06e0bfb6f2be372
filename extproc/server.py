"""Wires one extproc process: Redis client, fleet watcher, in-flight tracker, tenants and quotas, scheduler,
gRPC server, metrics.

``serve`` is the only place these parts meet and the only reader of the whole configuration (each part gets
the section it reads); it runs until cancelled and then stops gracefully (in-flight
streams get a grace period, the watcher's loops are cancelled, the Redis client is closed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from extproc.assembly import build_service
from extproc.catalogue import Catalogue
from extproc.catalogue_source import CatalogueSource
from extproc.disagg import DisaggPlan
from extproc.endpoint_picker import GIE_MODE
from extproc.inflight import InflightTracker
from extproc.kvcache.lookup import CacheLookup
from extproc.kvcache.subscriber import KVEventSubscriptions
from extproc.kvcache.wiring import build_kv_cache
from extproc.metrics import Metrics
from extproc.peers import PeerExchange, PeerKeys
from extproc.pipeline import CapacitySignal
from extproc.pipeline.cold_start import ColdStarts
from extproc.quota import QuotaStore
from extproc.replica import ReplicaState
from extproc.scheduling import RequestProfiler, build_profiler, build_scheduler
from extproc.service import ExtProcService
from extproc.siblings import Placed, Siblings, SiblingSocket, own_state
from extproc.tenancy import TenantDirectory
from extproc.watcher import FleetWatcher
from poolgate.kernel.cancel import cancel_and_wait
from poolgate.kernel.config import Config, TlsServerFiles
from poolgate.kernel.keys import QuotaKeys
from poolgate.kernel.reload import ConfigFileWatch
from poolgate.kernel.store import FleetStore, RedisLike, connect
from poolgate.kernel.tls import bind_grpc

log = logging.getLogger(__name__)

GRPC_MESSAGE_MARGIN = 64 * 1024
"""Room for the ext_proc envelope and headers on top of the largest accepted body."""
SHUTDOWN_GRACE_S = 5.0
SIBLING_SEND_S = 0.05
"""How often changes made without a placement or a release (settled reservations, written in-flight counts)
go to the siblings."""
HEALTH_SERVICES = ("", ext_proc_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name)
"""grpc.health.v1 answers for the whole server ("") and for the ext_proc service by name."""


def grpc_options(max_request_bytes: int) -> list[tuple[str, int]]:
    limit = max_request_bytes + GRPC_MESSAGE_MARGIN
    return [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def redis_client(redis_url: str) -> RedisLike:
    """Short timeouts and few quick retries: a refresh that fails fast keeps the snapshot-age metric honest
    and the next periodic refresh is the real retry."""
    return connect(redis_url, max_connections=None, socket_timeout=1.0, socket_connect_timeout=1.0, retries=1)


async def serve(
    config: Config,
    redis_url: str,
    host: str,
    port: int,
    metrics_port: int | None = None,
    on_listening: Callable[[int], None] | None = None,
    config_path: str | None = None,
    sibling_ports: tuple[int, ...] = (),
) -> None:
    """Run extproc until cancelled. ``on_listening`` gets the bound port (useful with port 0). Raises
    ``ConfigError`` before listening when a configured tokenizer cannot be loaded. With ``config_path`` the
    file is watched and a changed model catalogue is used at once (no restart, no dropped request).
    ``sibling_ports``: the gRPC ports of the extproc processes started with this one on this host (its own
    among them), which tell each other every placement at once (``siblings``)."""
    profiler = build_profiler(config.scheduling)
    metrics = Metrics()
    metrics_server = None
    if metrics_port is not None:
        metrics_server, _ = start_http_server(metrics_port, addr=host, registry=metrics.registry)
        log.info("extproc metrics on http://%s:%d/metrics", host, metrics_server.server_port)
    client = redis_client(redis_url)
    links = sibling_ports if port in sibling_ports and len(sibling_ports) > 1 else ()
    service, watcher, catalogue, kv_cache, siblings = _assemble(config, client, metrics, profiler, port, links)
    server, health, bound = await _grpc_server(service, host, port, config.extproc.max_request_bytes,
                                               config.tls.extproc)
    watch_tasks = watcher.start()
    if siblings is not None:
        watch_tasks.append(asyncio.create_task(_hear_siblings(siblings), name="siblings"))
    kv_task = (asyncio.create_task(kv_cache[1].follow(watcher, metrics=metrics), name="kv-events")
               if kv_cache is not None else None)
    ready_task = asyncio.create_task(_serving_after_first_snapshot(watcher, health), name="health-ready")
    reload_task = None
    if config_path is not None:
        reload_task = asyncio.create_task(ConfigFileWatch(config_path, config).run(
            config.catalogue.reload_interval_s, lambda changed: catalogue.apply(changed.catalogue)),
            name="config-reload")
    try:
        await watcher.refresh()
        await server.start()
        if on_listening is not None:
            on_listening(bound)
        # Not gRPC's wait_for_termination: cancelling it cancels the future the server's own stop awaits
        # (grpcio 1.7x), and the stop then raised CancelledError before the watcher and Redis were closed.
        ended, _ = await asyncio.wait(watch_tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in ended:  # the loops run until cancelled: one that ended failed, and that ends extproc
            task.result()
    finally:
        ready_task.cancel()
        if reload_task is not None:
            reload_task.cancel()
        if kv_task is not None:
            kv_task.cancel()
        await asyncio.shield(_stop(server, watch_tasks, watcher, client, health))
        if kv_task is not None:  # its subscriptions close their sockets as it ends
            await asyncio.gather(kv_task, return_exceptions=True)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


KvCache = tuple[CacheLookup, KVEventSubscriptions]


def _assemble(config: Config, client: RedisLike, metrics: Metrics, profiler: RequestProfiler, port: int = 0,
              sibling_ports: tuple[int, ...] = ()) -> (
        tuple[ExtProcService, FleetWatcher, CatalogueSource, KvCache | None, Siblings | None]):
    """The servicer over the fleet watcher, each part given the configuration's section it reads; the KV-event
    parts raise ConfigError (before anything listens) when a pool's tokenizer cannot load."""
    inflight = InflightTracker()
    capacity_changed = CapacitySignal()
    watcher = FleetWatcher(FleetStore(client, config.key_prefix), config.pools, config.extproc, inflight, metrics,
                           on_refresh=capacity_changed.notify)
    quotas = (QuotaStore(client, QuotaKeys(config.key_prefix), config.tenancy.lease_s)
              if any(t.has_quota for t in config.tenants) else None)
    catalogue = CatalogueSource(Catalogue(config.catalogue))
    kv_cache = build_kv_cache(config.extproc.kv_events, config.pools, lambda: watcher.snapshot)
    replica = ReplicaState.build(config.scheduling, config.tenancy, config.pools)
    replica.reservations.exchange_s = watcher.exchange_s
    lookup = kv_cache[0] if kv_cache is not None else None
    siblings = _siblings(port, sibling_ports, watcher.replica_id, replica, inflight, lookup)
    service = build_service(build_scheduler(config.scheduling), watcher, inflight, metrics,
                            max_request_bytes=config.extproc.max_request_bytes, scheduling=config.scheduling,
                            profiler=profiler, tenants=TenantDirectory(config.tenancy, config.tenants),
                            quotas=quotas, catalogue=catalogue, capacity_changed=capacity_changed,
                            genai_metrics=config.observability.genai_metrics,
                            header_pin=config.extproc.endpoint_picker_mode == GIE_MODE,
                            model_tasks={pool.model: pool.task for pool in config.pools},
                            prefix_cache=lookup,
                            disagg=DisaggPlan.from_config(config),
                            cold_starts=ColdStarts.from_config(config.pools, config.autoscale),
                            pools=config.pools, replica=replica, queue_changed=watcher.flush_soon,
                            siblings=siblings)
    watcher.publish_queue(replica.queue.held_by_domain)
    peers = PeerExchange(PeerKeys(config.key_prefix), watcher.replica_id, replica.reservations,
                         affinity=replica.affinity, queue_order=replica.queue_order, siblings=siblings,
                         placed_prefixes=replica.placed_prefixes,
                         on_placed=lookup.placed_elsewhere if lookup is not None else None)
    watcher.share_reservations(peers)
    if siblings is not None:
        def siblings_changed() -> None:
            peers.merge()
            inflight.apply_siblings(*siblings.view.inflight())
        siblings.on_change = siblings_changed
    return service, watcher, catalogue, kv_cache, siblings


def _siblings(port: int, sibling_ports: tuple[int, ...], replica_id: str, replica: ReplicaState,
              inflight: InflightTracker, lookup: CacheLookup | None) -> Siblings | None:
    """The link to the other processes of this host (None when started alone)."""
    if not sibling_ports:
        return None
    try:
        link = SiblingSocket(port, sibling_ports)
    except OSError as exc:  # the name is taken: run alone, through Redis, rather than not at all
        log.warning("extproc siblings: cannot listen (%s); sharing placements through Redis only", exc)
        return None
    siblings = Siblings(replica_id, link, own_state(replica.reservations, inflight))

    def placed(news: Placed) -> None:
        if lookup is not None:
            lookup.placed_elsewhere(news.worker_id, news.pending_keys)
        replica.affinity.apply(news.affinity)
    siblings.on_placed = placed
    return siblings


async def _hear_siblings(siblings: Siblings) -> None:
    """Take the siblings' datagrams as they arrive (the pick also takes them first), and send what changed
    here without a placement (reservations settling, in-flight writes) and the beat."""
    loop = asyncio.get_running_loop()
    fileno = siblings.fileno()
    loop.add_reader(fileno, siblings.receive)
    try:
        while True:
            siblings.send()
            await asyncio.sleep(SIBLING_SEND_S)
    finally:
        loop.remove_reader(fileno)
        siblings.close()


async def _grpc_server(service: ExtProcService, host: str, port: int, max_request_bytes: int,
                       tls: TlsServerFiles | None = None) -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
    """The ext_proc and health services on one server (TLS from ``tls``'s files, rotating, when given),
    NOT_SERVING until the first snapshot; and its port."""
    server = grpc.aio.server(options=grpc_options(max_request_bytes))
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(service, server)
    health = health_aio.HealthServicer()
    for name in HEALTH_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = bind_grpc(server, f"{host}:{port}", tls, "tls.extproc")
    if bound == 0:
        raise OSError(f"extproc cannot listen on {host}:{port}")
    return server, health, bound


async def _serving_after_first_snapshot(watcher: FleetWatcher, health: health_aio.HealthServicer) -> None:
    """SERVING once a fleet snapshot was read: before that every pick would answer 503 (no worker known),
    so a load balancer should send this replica nothing yet. Later Redis outages keep it SERVING: the last
    snapshot still routes well (degraded, visible in the metrics)."""
    await watcher.refreshed.wait()
    for name in HEALTH_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("extproc health: SERVING")


async def _stop(server: grpc.aio.Server, watch_tasks: list[asyncio.Task[None]], watcher: FleetWatcher,
                client: RedisLike, health: health_aio.HealthServicer) -> None:
    await health.enter_graceful_shutdown()  # NOT_SERVING first, so probes stop sending while streams drain
    await server.stop(SHUTDOWN_GRACE_S)
    await cancel_and_wait(watch_tasks)
    for task in watch_tasks:
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("fleet watcher's %s failed", task.get_name(), exc_info=error)
    try:
        await asyncio.wait_for(watcher.flush(), timeout=1.0)
        await asyncio.wait_for(watcher.leave(), timeout=1.0)
    except Exception:  # best effort: counters of a stopped replica are released by the streams ending
        log.debug("final in-flight flush failed", exc_info=True)
    await client.aclose()
