"""The fleet's xDS snapshot: built from the fleet, checked, and published to the cache the ADS server reads.

``FleetSnapshots.update`` turns the fleet into resources (``build``, ``endpoint_table``), checks that the
snapshot holds together (``consistency_problems``, as go-control-plane's ``Snapshot.Consistent``: every cluster
a route can name is served, every EDS cluster has its assignment and every assignment its cluster), and sets
it in the ``SnapshotCache``; then it tells its listener (the ADS server) which type URLs changed. A snapshot
that does not hold together is refused (logged once per set of problems, and counted: the controller's
``poolgate_xds_snapshots_refused``), and Envoy keeps the last good one. Only the clusters whose endpoints
changed (``endpoint_key``) are built again. ``update_off_loop`` does the build in a worker thread, so a large
rebuild does not stall the registry API on the same event loop. Nothing here speaks gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeAlias

from envoy.config.cluster.v3 import cluster_pb2

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, build_clusters, short_type
from controller.xds.cache import Snapshot, SnapshotCache
from controller.xds.endpoint_table import LARGE_CLUSTER, EndpointTable, suggested_shards
from poolgate.kernel.config import PoolSpec, TlsSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import FALLBACK_CLUSTER, pool_clusters

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
Fleet: TypeAlias = Sequence[WorkerRecord] | Mapping[str, WorkerRecord]
"""The whole fleet as read: a list, or by id (a ``FleetView``'s records, not copied)."""


def eds_names(clusters: Snapshot) -> frozenset[str]:
    """The load assignment names the EDS clusters of ``clusters`` ask for (``service_name``, else the name)."""
    names = set()
    for wire in clusters.wires.values():
        cluster = cluster_pb2.Cluster.FromString(wire)
        if cluster.type == cluster_pb2.Cluster.EDS:
            names.add(cluster.eds_cluster_config.service_name or cluster.name)
    return frozenset(names)


def routed_clusters(pools: Sequence[PoolSpec]) -> frozenset[str]:
    """The clusters a request can be routed to: each pool's (extproc names one in the cluster header) and the
    fallback cluster (the bootstrap's fail-open route). The bootstrap's route table does not validate its
    clusters (they arrive later over CDS), so Envoy would not refuse a missing one: its requests would end in
    503s."""
    return frozenset({FALLBACK_CLUSTER, *(name for pool in pools
                                          for name in pool_clusters(pool.name, pool.endpoint_shards))})


def consistency_problems(wanted: frozenset[str], endpoints: Snapshot, routed: frozenset[str] = frozenset(),
                         clusters: Snapshot | None = None) -> list[str]:
    """What is wrong with ``endpoints`` for clusters that ask for the assignments ``wanted``, and with
    ``clusters`` for routes that name ``routed`` (empty: nothing)."""
    problems = [f"route's cluster {name} is not served" for name in
                sorted(routed - (clusters.wires.keys() if clusters is not None else set()))]
    problems += [f"cluster {name} has no load assignment" for name in sorted(wanted - endpoints.wires.keys())]
    problems += [f"load assignment {name} has no cluster" for name in sorted(endpoints.wires.keys() - wanted)]
    return problems


class FleetSnapshots:
    """The clusters and load assignments of one config's pools, published to ``cache`` as the fleet changes.

    ``on_publish`` is told the type URLs each publish changed (the ADS server wakes its streams with them).
    """

    def __init__(self, pools: tuple[PoolSpec, ...], cache: SnapshotCache, on_publish: Callable[[Sequence[str]], None],
                 tls: TlsSettings | None = None, *, fallback_period_s: float | None = None,
                 fallback_quiet_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._pools = tuple(pools)
        self._routed = routed_clusters(self._pools)
        self._cache = cache
        self._on_publish = on_publish
        self._table = EndpointTable(self._pools)
        """Per cluster, what Envoy was sent of its workers, serialized."""
        self.assignments_built = 0
        """Cluster load assignments built so far (a one-worker change builds one)."""
        self.refused = 0
        """Snapshots refused because they did not hold together (``consistency_problems``); none is expected."""
        self._refused_for: tuple[str, ...] = ()
        """The problems of the last refusal, logged once (the next update is likely refused for the same)."""
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
        self._wanted: tuple[str, frozenset[str]] = (self._clusters.version, eds_names(self._clusters))
        """The assignment names of the clusters last published, by their snapshot's version."""
        # Nothing is cached, so nothing is served, before the first ``update``: a controller binds its port
        # before it has read the fleet, and an Envoy that reconnects meanwhile kept its endpoints. An empty
        # first snapshot would make it drop them all until the read came; unanswered, it keeps them.

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
        """Cache ``snapshots`` and tell the listener what changed, if they hold together; returns the version
        served (the last good one when they are refused)."""
        problems = self._problems(snapshots)
        if problems:
            # A bug in the build, not in the fleet: Envoy keeps what it has rather than lose a cluster's hosts
            # or route to a cluster it was never sent. Not raised, as the bridge would stop pushing at all.
            self.refused += 1
            if tuple(problems) != self._refused_for:
                self._refused_for = tuple(problems)
                log.error("xds: snapshot not published, Envoy keeps version %s: %s", self._cache.version(),
                          "; ".join(problems))
            return self._cache.version()
        self._refused_for = ()
        changed = self._cache.set(snapshots)
        version = self._cache.version()
        if changed:
            log.debug("xds: version %s (%s changed)", version, ", ".join(short_type(t) for t in changed))
            self._on_publish(tuple(changed))
        return version

    def _problems(self, snapshots: Sequence[Snapshot]) -> list[str]:
        """What keeps the clusters and assignments that would be served from holding together (empty: none)."""
        by_type = {snapshot.type_url: snapshot for snapshot in snapshots}
        clusters = by_type.get(CLUSTER_TYPE_URL) or self._cache.get(CLUSTER_TYPE_URL)
        endpoints = by_type.get(ENDPOINT_TYPE_URL) or self._cache.get(ENDPOINT_TYPE_URL)
        if clusters is None or endpoints is None:
            return []  # not served yet: the first update publishes both
        if self._wanted[0] != clusters.version:
            self._wanted = (clusters.version, eds_names(clusters))
        return consistency_problems(self._wanted[1], endpoints, self._routed, clusters)

    @property
    def version(self) -> str:
        return self._cache.version()

    def stop(self) -> None:
        """Cancel a pending fallback send."""
        if self._fallback_timer is not None:
            self._fallback_timer.cancel()
            self._fallback_timer = None
