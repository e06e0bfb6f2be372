"""The ADS protocol server: speaks xDS (CDS + EDS) to any number of Envoys, incremental or state-of-the-world.

It serves what a ``SnapshotCache`` holds and never builds or publishes (``snapshots.FleetSnapshots`` does);
``notify`` wakes every connected stream with the type URLs that changed, and each stream decides what its
Envoy still needs. The bootstraps poolgate renders use delta xDS (``DeltaAggregatedResources``,
``delta.DeltaAdsStream``): an Envoy is sent exactly the resources whose version changed, so one worker's
change sends one cluster's load assignment (a pool's, or one shard's of a large pool:
``PoolSpec.endpoint_shards``). State-of-the-world (``StreamAggregatedResources``, ``AdsStream``) stays served
for Envoys configured with ``api_type: GRPC``: it sends only the load assignments whose version changed too,
but every CDS answer holds every cluster. Envoy keeps its last resources while the controller is away, so
this server is never in a request's path. It answers nothing before the cache holds a snapshot: a stream
opened earlier, delta or not, waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, SERVED_TYPES, short_type
from controller.xds.cache import SnapshotCache
from controller.xds.delta import DeltaAdsStream
from controller.xds.stream import StreamState
from poolgate.kernel.config import TlsServerFiles
from poolgate.kernel.tls import bind_grpc

log = logging.getLogger(__name__)

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


class AdsServer:
    """ADS over gRPC from a snapshot cache it only reads: ``notify`` wakes every stream with the changed types."""

    def __init__(self, cache: SnapshotCache) -> None:
        self._cache = cache
        self._streams: dict[_Stream, asyncio.Queue[_Event]] = {}
        self._server: grpc.aio.Server | None = None

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

    def notify(self, changed: Sequence[str]) -> None:
        """The cache's ``changed`` type URLs have a new version: every stream decides what its Envoy needs.
        Call it from the event loop the server runs on (it wakes streams without awaiting)."""
        for inbox in self._streams.values():
            inbox.put_nowait(tuple(changed))

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
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
