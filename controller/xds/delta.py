"""Incremental (delta) ADS: the protocol state of one Envoy on ``DeltaAggregatedResources``.

In delta xDS the server tracks, per type URL, which resources the Envoy has and at which version, and sends
only the difference: the resources whose version changed (``resources``) and those it has that are gone
(``removed_resources``). One worker's change so sends one pool's ClusterLoadAssignment, whatever the fleet's
size. Envoy names what it wants with ``resource_names_subscribe``/``_unsubscribe`` (``*``, or a first request
with no names, is the wildcard; clusters only) and, on a reconnect, what it already holds with
``initial_resource_versions``: a resource it holds at the current version is not sent again. Versions are
content hashes (``cache``), so they survive a controller restart.

An ACK (a nonce, no error) confirms; a NACK (``error_detail``) keeps Envoy on its previous resources: the
rejected versions are not offered again (that would loop), the next change of a resource offers it anew.
No I/O here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from controller.xds.build import CLUSTER_TYPE_URL, SERVED_TYPES, short_type
from controller.xds.cache import SnapshotCache
from controller.xds.stream import StreamState

log = logging.getLogger(__name__)

WILDCARD = "*"

MAX_PENDING = 64
"""Responses awaiting an answer kept per type; older ones are forgotten (Envoy answers each, in order)."""


@dataclass
class DeltaSubscription:
    """One type URL on one delta stream: what Envoy asked for and what it holds."""

    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    """Names subscribed explicitly (besides the wildcard)."""
    held: dict[str, str] = field(default_factory=dict)
    """Resource name → the version Envoy has (sent on this stream, or declared on reconnect)."""
    pending: dict[str, tuple[str, dict[str, tuple[str, str | None]]]] = field(default_factory=dict)
    """Nonce not yet answered → (system version, name → (version sent, version Envoy held before))."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Resource name → a version Envoy NACKed: not offered again until the resource changes."""
    sent_version: str = ""
    acked_version: str = ""
    last_error: str = ""

    def wants(self, name: str) -> bool:
        return self.wildcard or name in self.names


class DeltaAdsStream(StreamState):
    """Turns delta requests and cache changes into delta responses for one Envoy."""

    def __init__(self, cache: SnapshotCache, peer: str = "") -> None:
        super().__init__(cache, peer)
        self.subscriptions: dict[str, DeltaSubscription] = {}

    def on_request(self, request: discovery_pb2.DeltaDiscoveryRequest) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        type_url = self._served_type(request)
        if type_url is None:
            return []
        subscription = self.subscriptions.get(type_url)
        if subscription is None:
            subscription = self.subscriptions[type_url] = DeltaSubscription()
            # A first request naming nothing is the legacy wildcard, which exists for clusters only.
            subscription.wildcard = not request.resource_names_subscribe and type_url == CLUSTER_TYPE_URL
            subscription.held.update(request.initial_resource_versions)
        if request.response_nonce:
            self._answered(type_url, subscription, request)
        for name in request.resource_names_subscribe:
            if name == WILDCARD:
                subscription.wildcard = True
            else:
                subscription.names.add(name)
                if name not in request.initial_resource_versions:
                    subscription.held.pop(name, None)  # asked for anew: Envoy does not hold it (any more)
        for name in request.resource_names_unsubscribe:
            if name == WILDCARD:
                subscription.wildcard = False
            else:
                subscription.names.discard(name)
            if not subscription.wants(name):
                subscription.held.pop(name, None)
        return self._respond(type_url)

    def on_change(self, type_urls: Sequence[str]) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        responses: list[discovery_pb2.DeltaDiscoveryResponse] = []
        for type_url in SERVED_TYPES:
            if type_url in type_urls and type_url in self.subscriptions:
                responses.extend(self._respond(type_url))
        return responses

    def _answered(self, type_url: str, subscription: DeltaSubscription,
                  request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        sent = subscription.pending.pop(request.response_nonce, None)
        if sent is None:
            return  # a nonce from before a reconnect, or answered already
        version, resources = sent
        if request.HasField("error_detail"):
            subscription.last_error = request.error_detail.message
            for name, (offered, before) in resources.items():
                subscription.rejected[name] = offered
                if subscription.held.get(name) == offered:  # Envoy kept what it had
                    if before is None:
                        del subscription.held[name]
                    else:
                        subscription.held[name] = before
            log.error("xds: node %s rejected %s version %s (%d resources): %s", self.node_id, short_type(type_url),
                      version, len(resources), request.error_detail.message)
            return
        subscription.last_error = ""
        for name in resources:
            subscription.rejected.pop(name, None)
        subscription.acked_version = version if subscription.pending else subscription.sent_version
        log.debug("xds: node %s acked %s version %s", self.node_id, short_type(type_url), version)

    def _respond(self, type_url: str) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        """What Envoy lacks of the subscribed resources, and what it holds that is gone; nothing if neither."""
        snapshot = self._cache.get(type_url)
        if snapshot is None:
            return []
        subscription = self.subscriptions[type_url]
        held = subscription.held
        versions = snapshot.versions
        wanted = sorted(versions) if subscription.wildcard else sorted(n for n in subscription.names if n in versions)
        rejected = subscription.rejected
        changed = [name for name in wanted if held.get(name) != versions[name] and rejected.get(name) != versions[name]]
        removed = sorted(name for name in held if name not in versions)
        subscription.sent_version = snapshot.version
        if not changed and not removed:
            if not subscription.pending and not any(rejected.get(name) == versions[name] for name in wanted):
                subscription.acked_version = snapshot.version  # Envoy holds everything at this version
                subscription.last_error = ""
            return []
        nonce = self._next_nonce()
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=snapshot.version, type_url=type_url, nonce=nonce, removed_resources=removed
        )
        for name in changed:
            entry = response.resources.add(name=name, version=versions[name])
            entry.resource.type_url, entry.resource.value = type_url, snapshot.wires[name]
        sent = {name: (versions[name], held.get(name)) for name in changed}
        held.update((name, versions[name]) for name in changed)
        for name in removed:
            del held[name]
        subscription.pending[nonce] = (snapshot.version, sent)
        while len(subscription.pending) > MAX_PENDING:
            del subscription.pending[next(iter(subscription.pending))]
        self.resources_sent += len(changed)
        return [response]
