"""The ADS server: speaks xDS (CDS + EDS) to any number of Envoys, incremental or state-of-the-world.

``update`` builds resources from the fleet (``build``), stores them as versioned snapshots (``cache``), and
wakes every connected stream; each stream decides what its Envoy still needs. Only the clusters whose
endpoints changed (``endpoint_key``) are built again. The bootstraps poolgate renders use delta xDS
(``DeltaAggregatedResources``, ``delta.DeltaAdsStream``): an Envoy is sent exactly the resources whose
version changed, so one worker's change sends one cluster's load assignment (a pool's, or one shard's of a
large pool: ``PoolSpec.endpoint_shards``). State-of-the-world
(``StreamAggregatedResources``, ``AdsStream``) stays served for Envoys configured with ``api_type: GRPC``:
it sends only the load assignments whose version changed too, but every CDS answer holds every cluster.
``update_off_loop`` does the build in a worker thread, so a large rebuild does not stall the registry API on
the same event loop. Envoy keeps its last resources while the controller is away, so this server is never
in a request's path. It answers nothing before its first ``update`` (the caller's first full read of the
fleet): a stream opened earlier, delta or not, waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, SERVED_TYPES, build_clusters, short_type
from controller.xds.cache import Snapshot, SnapshotCache
from controller.xds.delta import DeltaAdsStream
from controller.xds.endpoint_table import LARGE_CLUSTER, EndpointTable, suggested_shards
from controller.xds.stream import StreamState
from poolgate.kernel.config import PoolSpec, TlsServerFiles, TlsSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.tls import bind_grpc

log = logging.getLogger(__name__)

FALLBACK_PERIOD_S = 1.0
"""The fail-open route's assignment (every usable worker of every pool) is rebuilt at most this often, in an
update of its own, never in the one that carries a pool's change: with it, one worker's change would send the
whole fleet to every Envoy (10,000 endpoints for one) and wait for Envoy to take them. It serves only while
extproc is away, so it may trail the pools' assignments by up to this long."""
FALLBACK_APART_S = 0.05
"""A fallback due at once still follows the pools' change by this long."""
LARGE_FALLBACK = 2000
"""From this many endpoints on, the fallback follows ``LARGE_FALLBACK_PERIOD_S`` and ``LARGE_FALLBACK_QUIET_S``."""
LARGE_FALLBACK_PERIOD_S = 5.0
"""A large fleet's fallback period. Sent every second, a 10,000-worker fallback (333 KB that every Envoy
applies) kept the controller and every Envoy busy often enough that one change in ten waited behind it
(100-300 ms instead of 30)."""
LARGE_FALLBACK_QUIET_S = 0.25
"""A large fleet's due fallback waits until no pool's assignment has changed for this long (one period at
most): sent into a burst of changes, the next change of the burst would queue behind it at every Envoy."""
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""A large fleet's EDS answer can pass grpc's 4 MiB default."""


@dataclass
class Subscription:
    """One type URL on one stream: what Envoy asked for, and what it got and accepted."""

    names: frozenset[str] | None
    """``None`` = wildcard (every resource)."""
    sent_version: str = ""
    sent_resources: dict[str, str] = field(default_factory=dict)
    """EDS: resource name → the version last sent on this stream."""
    sent_nonce: str = ""
    acked_version: str = ""
    last_error: str = ""


class AdsStream(StreamState):
    """The protocol state of one Envoy connection; turns requests and cache changes into responses.

    No I/O here, so the ACK/NACK rules are testable without gRPC.
    """

    def __init__(self, cache: SnapshotCache, peer: str = "") -> None:
        super().__init__(cache, peer)
        self.subscriptions: dict[str, Subscription] = {}

    def on_request(self, request: discovery_pb2.DiscoveryRequest) -> list[discovery_pb2.DiscoveryResponse]:
        type_url = self._served_type(request)
        if type_url is None:
            return []
        names = self._names(type_url, request.resource_names)
        subscription = self.subscriptions.get(type_url)
        if subscription is None:
            subscription = self.subscriptions[type_url] = Subscription(names)
            return self._respond(type_url)
        if request.response_nonce and request.response_nonce != subscription.sent_nonce:
            return []  # answers an older response; the newer one is already on its way
        if request.HasField("error_detail"):
            subscription.last_error = request.error_detail.message
            subscription.sent_resources.clear()  # not taken: the next version offers every resource again
            log.error("xds: node %s rejected %s version %s (keeps %r): %s", self.node_id, short_type(type_url),
                      subscription.sent_version, request.version_info, request.error_detail.message)
        elif request.response_nonce:
            subscription.acked_version = request.version_info
            subscription.last_error = ""
            log.debug("xds: node %s acked %s version %s", self.node_id, short_type(type_url), request.version_info)
        if not request.response_nonce or names != subscription.names:
            subscription.names = names
            return self._respond(type_url)
        return []

    def on_change(self, type_urls: Sequence[str]) -> list[discovery_pb2.DiscoveryResponse]:
        responses: list[discovery_pb2.DiscoveryResponse] = []
        for type_url in SERVED_TYPES:
            subscription = self.subscriptions.get(type_url)
            snapshot = self._cache.get(type_url)
            if type_url in type_urls and subscription and snapshot and snapshot.version != subscription.sent_version:
                responses.extend(self._respond(type_url, changed_only=type_url == ENDPOINT_TYPE_URL))
        return responses

    @staticmethod
    def _names(type_url: str, requested: Sequence[str]) -> frozenset[str] | None:
        # Legacy wildcard (an empty list) exists for clusters only; an empty EDS list subscribes to nothing.
        if "*" in requested or (not requested and type_url == CLUSTER_TYPE_URL):
            return None
        return frozenset(requested)

    def _respond(self, type_url: str, changed_only: bool = False) -> list[discovery_pb2.DiscoveryResponse]:
        """The subscribed resources at the cache's version; ``changed_only`` (EDS pushes) leaves out those
        this stream already sent at their current version, and sends nothing when none is left."""
        snapshot = self._cache.get(type_url)
        if snapshot is None:
            return []
        subscription = self.subscriptions[type_url]
        names = snapshot.selected_names(subscription.names)
        if changed_only:
            names = [n for n in names if subscription.sent_resources.get(n) != snapshot.versions.get(n)]
            if not names:
                subscription.sent_version = snapshot.version
                return []
        subscription.sent_version = snapshot.version
        subscription.sent_nonce = self._next_nonce()
        subscription.sent_resources.update((n, snapshot.versions.get(n, "")) for n in names)
        response = discovery_pb2.DiscoveryResponse(
            version_info=snapshot.version, type_url=type_url, nonce=subscription.sent_nonce
        )
        for name in names:
            response.resources.add(type_url=type_url, value=snapshot.wires[name])
        self.resources_sent += len(names)
        return [response]


_Request: TypeAlias = discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest
_Event: TypeAlias = _Request | tuple[str, ...] | None
"""What a stream's inbox carries: a request from Envoy, changed type URLs, or None for end of stream."""
_Stream: TypeAlias = AdsStream | DeltaAdsStream
Fleet: TypeAlias = Sequence[WorkerRecord] | Mapping[str, WorkerRecord]
"""The whole fleet as read: a list, or by id (a ``FleetView``'s records, not copied)."""


class _AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, cache: SnapshotCache, streams: dict[_Stream, asyncio.Queue[_Event]]) -> None:
        self._cache = cache
        self._streams = streams

    # Both handlers must be async generators themselves: grpc.aio runs any other handler in a thread.
    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for response in self._serve(AdsStream(self._cache, peer=context.peer()), request_iterator):
            yield response

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DeltaDiscoveryResponse]:
        async for response in self._serve(DeltaAdsStream(self._cache, peer=context.peer()), request_iterator):
            yield response

    async def _serve(self, stream: _Stream, request_iterator: AsyncIterator[Any]) -> AsyncIterator[Any]:
        inbox: asyncio.Queue[_Event] = asyncio.Queue()
        reader = asyncio.create_task(_read_requests(request_iterator, inbox))
        self._streams[stream] = inbox
        try:
            while (event := await inbox.get()) is not None:
                if isinstance(event, tuple):
                    responses: Sequence[Any] = stream.on_change(event)
                else:
                    if event.node.id and not stream.node_id:
                        log.info("xds: node %s connected from %s (%s)", event.node.id, stream.peer,
                                 "delta" if isinstance(stream, DeltaAdsStream) else "state of the world")
                    responses = stream.on_request(event)  # type: ignore[arg-type]  # a stream gets its own kind
                for response in responses:
                    yield response
        finally:
            self._streams.pop(stream, None)
            reader.cancel()
            log.info("xds: node %s disconnected", stream.node_id or stream.peer)


async def _read_requests(request_iterator: AsyncIterator[_Request], inbox: asyncio.Queue[_Event]) -> None:
    try:
        async for request in request_iterator:
            inbox.put_nowait(request)
    except asyncio.CancelledError:
        pass
    except Exception as exc:  # a reset stream ends this Envoy's session, never the server
        log.debug("xds: stream read ended: %r", exc)
    finally:
        inbox.put_nowait(None)


@dataclass(frozen=True)
class StreamStatus:
    """What one connected Envoy has been sent and has accepted, per type URL (for status and tests)."""

    node_id: str
    delta: bool
    """On incremental ADS (else state of the world)."""
    resources_sent: int
    """Resources sent on this stream so far."""
    sent: dict[str, str]
    acked: dict[str, str]
    errors: dict[str, str]


class GrpcService(Protocol):
    """Another gRPC service on the xDS port (Envoy's access log service)."""

    def add_to(self, server: grpc.aio.Server) -> None: ...


class XdsServer:
    """ADS for the pools of one config. ``update`` may be called as often as the fleet changes."""

    def __init__(self, pools: tuple[PoolSpec, ...], tls: TlsSettings | None = None, *,
                 fallback_period_s: float | None = None, fallback_quiet_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pools = tuple(pools)
        self._cache = SnapshotCache()
        self._streams: dict[_Stream, asyncio.Queue[_Event]] = {}
        self._server: grpc.aio.Server | None = None
        self._table = EndpointTable(self._pools)
        """Per cluster, what Envoy was sent of its workers, serialized."""
        self.assignments_built = 0
        """Cluster load assignments built so far (a one-worker change builds one)."""
        self._warned_large: set[str] = set()
        self._clock = clock
        self._given_period_s = fallback_period_s
        self._given_quiet_s = fallback_quiet_s
        self._fallback_at = float("-inf")
        self._fallback_stale = False
        """The fallback's assignment trails a change the pools' assignments already carry."""
        self._stale_since = float("-inf")
        self._pools_changed_at = float("-inf")
        self._fallback_timer: asyncio.TimerHandle | None = None
        self._building = False
        """An update's build runs in a worker thread (the table is its own meanwhile)."""
        self._clusters = Snapshot.of(CLUSTER_TYPE_URL, build_clusters(self._pools, tls))
        """The pools' clusters: fixed by the config, built once (re-offered by each update)."""
        # Nothing is cached, so nothing is served, before the first ``update``: a controller binds its port
        # before it has read the fleet, and an Envoy that reconnects meanwhile kept its endpoints. An empty
        # first snapshot would make it drop them all until the read came; unanswered, it keeps them.

    async def start(self, host: str = "127.0.0.1", port: int = 0, tls: TlsServerFiles | None = None,
                    services: Sequence[GrpcService] = ()) -> int:
        """Bind and serve (over TLS from ``tls``'s files, rotating, when given), with ``services`` beside ADS on
        the same port (Envoy reaches them over its xDS cluster); returns the bound port."""
        server = grpc.aio.server(options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ])
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
            _AdsServicer(self._cache, self._streams), server
        )
        for service in services:
            service.add_to(server)
        bound = bind_grpc(server, f"{host}:{port}", tls, "tls.xds")
        if bound == 0:
            raise OSError(f"xds: cannot bind {host}:{port}")
        await server.start()
        self._server = server
        log.info("xds: serving ADS on %s:%d%s", host, bound, " (TLS)" if tls is not None else "")
        return bound

    def update(self, workers: Fleet, changed: Collection[str] | None = None) -> str:
        """Rebuild the clusters whose endpoints changed, cache them, push changes; returns the snapshot version.
        ``workers`` is the whole fleet as read (the first call opens the service to every waiting stream);
        ``changed`` names the only workers that may differ from the last call (the bridge's delta: no other
        is looked at), None that any may. A fallback left stale is sent on its own once due; without a
        running event loop, call ``update`` again (nothing changed) while ``fallback_due``.

        Call it from the event loop the server runs on (it wakes streams without awaiting).
        """
        return self._apply(self._build(workers, changed))

    def worker_at(self, host: str, port: int) -> str | None:
        """The worker Envoy was sent at ``host:port`` (any thread: a dict read)."""
        return self._table.worker_at(host, port)

    async def update_off_loop(self, workers: Fleet, changed: Collection[str] | None = None) -> str:
        """``update`` with the build in a worker thread (only one update may run at a time, and ``workers``
        must not change until it returns)."""
        self._building = True
        try:
            endpoints = await asyncio.to_thread(self._build, workers, changed)
        finally:
            self._building = False
        return self._apply(endpoints)

    def _build(self, workers: Fleet, changed: Collection[str] | None) -> Snapshot | None:
        """The endpoint snapshot with the changed clusters rebuilt (None: nothing changed)."""
        fleet = workers if isinstance(workers, Mapping) else {worker.id: worker for worker in workers}
        touched = self._table.apply(fleet, changed)
        previous = self._cache.get(ENDPOINT_TYPE_URL)
        if previous is None:
            touched = set(self._table.clusters)
        elif not touched and not self.fallback_due:
            return None
        assignments = [self._table.assignment(cluster) for cluster in sorted(touched)]
        self.assignments_built += len(touched)
        self._warn_large(touched)
        now = self._clock()
        if previous is None or (not touched and now - self._fallback_at >= self._fallback_schedule()[0]):
            assignments.append(self._table.fallback())
            self._fallback_at, self._fallback_stale = now, False
        else:
            if not self._fallback_stale:
                self._stale_since = now
            self._fallback_stale = True  # sent on its own once due (``_schedule_fallback``)
        if touched:
            self._pools_changed_at = now
        if previous is None:
            return Snapshot.of(ENDPOINT_TYPE_URL, assignments)
        return previous.replaced(assignments)

    def _warn_large(self, clusters: Collection[str]) -> None:
        """Once per cluster: it passed ``LARGE_CLUSTER`` endpoints, so each of its workers' changes resends all."""
        for cluster in clusters:
            size = self._table.size(cluster)
            if size > LARGE_CLUSTER and cluster not in self._warned_large:
                self._warned_large.add(cluster)
                log.warning("xds: cluster %s holds %d endpoints, and one worker's change resends them all to every "
                            "Envoy; raise its pool's endpoint_shards to about %d", cluster, size,
                            suggested_shards(self._table.pool_size(cluster)))

    def _fallback_schedule(self) -> tuple[float, float]:
        """The fallback's period and quiet wait: as given, else by the fleet's size (``LARGE_FALLBACK``)."""
        large = len(self._table) >= LARGE_FALLBACK
        period, quiet = (LARGE_FALLBACK_PERIOD_S, LARGE_FALLBACK_QUIET_S) if large else (FALLBACK_PERIOD_S,
                                                                                      FALLBACK_APART_S)
        return (period if self._given_period_s is None else self._given_period_s,
                quiet if self._given_quiet_s is None else self._given_quiet_s)

    @property
    def fallback_due(self) -> bool:
        """The fallback's assignment trails a change and may be rebuilt now: call ``update`` again."""
        return self._fallback_stale and self._clock() - self._fallback_at >= self._fallback_schedule()[0]

    def _apply(self, endpoints: Snapshot | None) -> str:
        version = self._publish([self._clusters, *([endpoints] if endpoints is not None else [])])
        self._schedule_fallback()
        return version

    def _schedule_fallback(self) -> None:
        """Send a stale fallback once due and the pools quiet, in an update of its own (a caller without an
        event loop calls ``update`` again while ``fallback_due`` instead). Each pool change puts it off again,
        up to one period past when it would have been due."""
        if not self._fallback_stale:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        period, quiet = self._fallback_schedule()
        due = max(self._fallback_at + period, self._stale_since)
        at = min(max(due, self._pools_changed_at + quiet), due + period)
        if self._fallback_timer is not None:
            if self._fallback_timer.when() - loop.time() >= at - self._clock() - 0.001:
                return  # already set for then or later
            self._fallback_timer.cancel()
        self._fallback_timer = loop.call_later(max(0.0, at - self._clock()), self._send_fallback)

    def _send_fallback(self) -> None:
        self._fallback_timer = None
        previous = self._cache.get(ENDPOINT_TYPE_URL)
        if not self._fallback_stale or self._building or previous is None:
            return  # an update in a worker thread owns the table now; its end schedules this again
        self._fallback_at, self._fallback_stale = self._clock(), False
        self._publish([self._clusters, previous.replaced([self._table.fallback()])])

    def _publish(self, snapshots: Sequence[Snapshot]) -> str:
        changed = self._cache.set(snapshots)
        version = self._cache.version()
        if changed:
            log.debug("xds: version %s (%s changed), %d streams", version,
                      ", ".join(short_type(t) for t in changed), len(self._streams))
            for inbox in self._streams.values():
                inbox.put_nowait(tuple(changed))
        return version

    @property
    def version(self) -> str:
        return self._cache.version()

    def streams(self) -> list[StreamStatus]:
        return [
            StreamStatus(
                node_id=stream.node_id,
                delta=isinstance(stream, DeltaAdsStream),
                resources_sent=stream.resources_sent,
                sent={t: s.sent_version for t, s in stream.subscriptions.items()},
                acked={t: s.acked_version for t, s in stream.subscriptions.items()},
                errors={t: s.last_error for t, s in stream.subscriptions.items() if s.last_error},
            )
            for stream in self._streams
        ]

    async def stop(self, grace: float = 1.0) -> None:
        if self._fallback_timer is not None:
            self._fallback_timer.cancel()
            self._fallback_timer = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
