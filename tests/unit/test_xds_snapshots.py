"""The snapshot side of xDS apart from the protocol: published only when clusters and assignments agree."""

from __future__ import annotations

import pytest

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, build_clusters, build_endpoints
from controller.xds.cache import Snapshot, SnapshotCache
from controller.xds.snapshots import FleetSnapshots, InconsistentSnapshot, consistency_problems, eds_names
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import FALLBACK_CLUSTER, cluster_name

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder", endpoint_shards=2))


def test_every_cluster_of_a_built_fleet_has_its_assignment() -> None:
    clusters = Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS))
    endpoints = Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS, []))
    assert cluster_name("chat") in eds_names(clusters) and FALLBACK_CLUSTER in eds_names(clusters)
    assert consistency_problems(eds_names(clusters), endpoints) == []


def test_a_missing_or_orphaned_assignment_is_named() -> None:
    clusters = Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS[:1]))
    endpoints = Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS[1:], []))
    problems = consistency_problems(eds_names(clusters), endpoints)
    assert f"cluster {cluster_name('chat')} has no load assignment" in problems
    assert any(p.startswith("load assignment pool-code") and p.endswith("has no cluster") for p in problems)


def test_an_inconsistent_snapshot_is_never_published() -> None:
    cache = SnapshotCache()
    told: list[tuple[str, ...]] = []
    snapshots = FleetSnapshots(POOLS, cache, lambda changed: told.append(tuple(changed)))
    version = snapshots.update([WorkerRecord(id="w1", pool="chat", model="llama", host="10.0.0.1", port=9000)])
    assert told == [(CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL)]
    stray = Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints((PoolSpec(name="gone", model="x"),), []))
    clusters, endpoints = cache.get(CLUSTER_TYPE_URL), cache.get(ENDPOINT_TYPE_URL)
    assert clusters is not None and endpoints is not None
    with pytest.raises(InconsistentSnapshot, match="has no cluster"):
        snapshots._publish([clusters, endpoints.replaced([stray.resources[cluster_name("gone")]])])
    assert cache.version() == version and len(told) == 1
