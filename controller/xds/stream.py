"""What every ADS stream keeps, state-of-the-world (``server.AdsStream``) or delta (``delta.DeltaAdsStream``):
the Envoy it speaks to, its nonces and how many resources it sent. The variants differ in what they track per
type URL and how they answer; the start of a request and the nonce counting are the same. No I/O here.
"""

from __future__ import annotations

import logging

from envoy.service.discovery.v3 import discovery_pb2

from controller.xds.build import SERVED_TYPES
from controller.xds.cache import SnapshotCache

log = logging.getLogger(__name__)


class StreamState:
    def __init__(self, cache: SnapshotCache, peer: str = "") -> None:
        self._cache = cache
        self.peer = peer
        self.node_id = ""
        self._nonce = 0
        self.resources_sent = 0
        """Resources sent on this stream so far (a one-worker change adds one, or two with the fallback)."""

    def _served_type(self, request: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest) -> (
            str | None):
        """The request's type URL, or None (logged) for a type this server does not serve. The first request
        that names its node names the stream's Envoy."""
        if request.node.id and not self.node_id:
            self.node_id = request.node.id
        if request.type_url not in SERVED_TYPES:
            log.warning("xds: node %s asked for unserved type %s; ignored", self.node_id, request.type_url)
            return None
        return request.type_url

    def _next_nonce(self) -> str:
        self._nonce += 1
        return str(self._nonce)
