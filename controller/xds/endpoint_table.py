"""``EndpointTable``: the clusters' load assignments, kept current one worker at a time.

A pool is one cluster, or ``endpoint_shards`` of them (``worker_cluster`` says which holds a worker). Each usable
worker's endpoint is serialized once, when what Envoy sees of it (``endpoint_key``) changes. A cluster's assignment
is then its members' bytes joined, and sent in that wire form (``Encoded``), never parsed back: for 10,000
endpoints ~8 ms, where parsing it back took ~3 ms more and building it field by field ~65 ms. One worker's change costs
its cluster's join, and nothing of the other clusters; with the ids that changed named (the bridge's delta) it looks
at no other worker at all. The fallback's assignment (every usable worker of every pool) is joined from the same
bytes.

Pure and synchronous; the xDS server owns one and calls it from one place at a time.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import address_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2

from controller.xds.cache import Encoded
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import FALLBACK_CLUSTER, pool_clusters, worker_cluster

log = logging.getLogger(__name__)

LARGE_CLUSTER = 2000
SHARD_SIZE = 1000
"""A cluster past ``LARGE_CLUSTER`` endpoints is warned about once (the xDS server), with the ``endpoint_shards``
that would put about ``SHARD_SIZE`` in each (``suggested_shards``): in one cluster of 10,000, one worker's
change took a lone Envoy 44 ms (p50), in ten of 1,000, 9 ms."""


def suggested_shards(workers: int) -> int:
    """The ``endpoint_shards`` that put about ``SHARD_SIZE`` of a pool's ``workers`` in each cluster."""
    return max(1, -(-workers // SHARD_SIZE))

HEALTH_BY_STATE: dict[WorkerState, int] = {
    WorkerState.READY: health_check_pb2.HEALTHY,
    WorkerState.BUSY: health_check_pb2.HEALTHY,
    WorkerState.DRAINING: health_check_pb2.DRAINING,
    WorkerState.FAILED: health_check_pb2.UNHEALTHY,
    WorkerState.STARTING: health_check_pb2.UNHEALTHY,
}
"""Busy still serves (it only scores lower in extproc); Draining finishes in-flight work but takes no new."""


def endpoint_key(worker: WorkerRecord) -> tuple[str, str, int, str]:
    """What of a worker Envoy sees: a change here (and only here, or in its pool) changes its cluster's load
    assignment."""
    return worker.id, worker.host, worker.port, worker.state.value


@functools.lru_cache(maxsize=1 << 16)
def is_ip(host: str) -> bool:
    """(cached: ``ipaddress`` parsing was half of a 10,000-worker build, and a full resync sees every host again)"""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


_NAME_FIELD = b"\x0a"
"""Tag of ``ClusterLoadAssignment.cluster_name`` (field 1, length-delimited)."""
_ENDPOINTS_FIELD = b"\x12"
"""Tag of ``ClusterLoadAssignment.endpoints`` (field 2): the one locality."""
_LB_ENDPOINTS_FIELD = b"\x12"
"""Tag of ``LocalityLbEndpoints.lb_endpoints`` (field 2)."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


@dataclass(frozen=True, slots=True)
class _Member:
    pool: str
    cluster: str
    key: tuple[str, str, int, str]
    address: tuple[str, int]
    entry: bytes
    """The worker's ``lb_endpoints`` entry, as it appears inside its cluster's locality."""


def _member(worker: WorkerRecord, cluster: str) -> _Member:
    lb_endpoint = endpoint_components_pb2.LbEndpoint(health_status=HEALTH_BY_STATE[worker.state])
    lb_endpoint.endpoint.hostname = worker.id
    lb_endpoint.endpoint.address.CopyFrom(address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=worker.host, port_value=worker.port)
    ))
    entry = _field(_LB_ENDPOINTS_FIELD, lb_endpoint.SerializeToString(deterministic=True))
    return _Member(worker.pool, cluster, endpoint_key(worker), (worker.host, worker.port), entry)


def _assignment(name: str, members: Iterable[_Member]) -> Encoded:
    """One load assignment, in wire form, with one locality holding ``members`` in order; of two members with
    one address only the first (one address is one host to Envoy)."""
    seen: set[tuple[str, int]] = set()
    entries = []
    for member in members:
        if member.address not in seen:
            seen.add(member.address)
            entries.append(member.entry)
    return Encoded(name, _field(_NAME_FIELD, name.encode()) + _field(_ENDPOINTS_FIELD, b"".join(entries)))


class EndpointTable:
    """The usable workers of the configured pools, by cluster, each with its endpoint serialized."""

    def __init__(self, pools: Sequence[PoolSpec]) -> None:
        self._shards = {pool.name: pool.endpoint_shards for pool in pools}
        self._by_cluster: dict[str, dict[str, _Member]] = {
            cluster: {} for pool in pools for cluster in pool_clusters(pool.name, pool.endpoint_shards)}
        self._members: dict[str, _Member] = {}
        self._by_address: dict[tuple[str, int], str] = {}
        """Which worker Envoy was sent at each address (Envoy's access log names the address only)."""

    def __len__(self) -> int:
        """Usable workers held (each one endpoint of the fallback)."""
        return len(self._members)

    @property
    def clusters(self) -> list[str]:
        return list(self._by_cluster)

    def size(self, cluster: str) -> int:
        """Usable workers in ``cluster``."""
        return len(self._by_cluster[cluster])

    def pool_size(self, cluster: str) -> int:
        """Usable workers of the pool ``cluster`` is a shard of (about its size times the pool's shards)."""
        members = self._by_cluster[cluster]
        if not members:
            return 0
        return len(members) * self._shards[next(iter(members.values())).pool]

    def apply(self, workers: Mapping[str, WorkerRecord], changed: Collection[str] | None = None) -> set[str]:
        """Take ``workers`` (the fleet by id); returns the clusters whose assignment changed. With ``changed``
        only those ids are looked at (a missing one left), the others are taken as unchanged; without, every
        worker is, and the ones not in ``workers`` left."""
        ids: Iterable[str] = workers if changed is None else changed
        touched: set[str] = set()
        if changed is None:
            for gone in self._members.keys() - workers.keys():
                touched.add(self._drop(gone))
        for worker_id in ids:
            worker = workers.get(worker_id)
            current = self._members.get(worker_id)
            if worker is not None and current is not None and current.key == endpoint_key(worker) \
                    and current.pool == worker.pool:
                continue
            if current is not None:
                touched.add(self._drop(worker_id))
            if worker is not None and self._usable(worker):
                member = _member(worker, worker_cluster(worker.pool, worker_id, self._shards[worker.pool]))
                self._members[worker_id] = self._by_cluster[member.cluster][worker_id] = member
                self._by_address.setdefault(member.address, worker_id)
                touched.add(member.cluster)
        return touched

    def _drop(self, worker_id: str) -> str:
        member = self._members.pop(worker_id)
        del self._by_cluster[member.cluster][worker_id]
        if self._by_address.get(member.address) == worker_id:
            del self._by_address[member.address]
        return member.cluster

    def worker_at(self, host: str, port: int) -> str | None:
        """The worker sent to Envoy at ``host:port`` (None: none now)."""
        return self._by_address.get((host, port))

    def _usable(self, worker: WorkerRecord) -> bool:
        """Workers of unknown pools, bad ports, and hosts that are not IP literals (EDS rejects names, and the
        pin compares ``ip:port``) are left out with a warning: Envoy would reject the whole update (NACK)."""
        if worker.pool not in self._shards:
            log.warning("worker %s names unknown pool %r; not sent to Envoy", worker.id, worker.pool)
        elif not 0 < worker.port < 65536:
            log.warning("worker %s port %d is out of range; not sent to Envoy", worker.id, worker.port)
        elif not is_ip(worker.host):
            log.warning("worker %s host %r is not an IP address; not sent to Envoy", worker.id, worker.host)
        else:
            return True
        return False

    def assignment(self, cluster: str) -> Encoded:
        """The cluster's load assignment, its workers in id order (empty when it has none)."""
        members = self._by_cluster[cluster]
        return _assignment(cluster, (members[worker_id] for worker_id in sorted(members)))

    def fallback(self) -> Encoded:
        """The fail-open route's assignment: every usable worker of every pool, in (pool, id) order."""
        return _assignment(FALLBACK_CLUSTER, (self._members[worker_id] for _, worker_id in
                                              sorted((member.pool, worker_id)
                                                     for worker_id, member in self._members.items())))
