"""The snapshot side of xDS apart from the protocol: published only when it holds together, else the last good
one stays served."""

from __future__ import annotations

import logging

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from prometheus_client import CollectorRegistry

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, build_clusters, build_endpoints
from controller.xds.cache import Snapshot, SnapshotCache
from controller.xds.metrics import XdsMetrics
from controller.xds.server import AdsStream
from controller.xds.snapshots import FleetSnapshots, consistency_problems, eds_names, routed_clusters
from controller.xds.xds_server import XdsServer
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import FALLBACK_CLUSTER, cluster_name, pool_clusters

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder", endpoint_shards=2))
W1 = WorkerRecord(id="w1", pool="chat", model="llama", host="10.0.0.1", port=9000)
W2 = WorkerRecord(id="w2", pool="chat", model="llama", host="10.0.0.2", port=9000)


def published(cache: SnapshotCache) -> tuple[Snapshot, Snapshot]:
    clusters, endpoints = cache.get(CLUSTER_TYPE_URL), cache.get(ENDPOINT_TYPE_URL)
    assert clusters is not None and endpoints is not None
    return clusters, endpoints


def fleet_snapshots() -> tuple[FleetSnapshots, SnapshotCache, list[tuple[str, ...]]]:
    cache = SnapshotCache()
    told: list[tuple[str, ...]] = []
    return FleetSnapshots(POOLS, cache, lambda changed: told.append(tuple(changed))), cache, told


def test_a_built_fleet_holds_together() -> None:
    clusters = Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS))
    endpoints = Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS, [W1]))
    assert cluster_name("chat") in eds_names(clusters) and FALLBACK_CLUSTER in eds_names(clusters)
    assert routed_clusters(POOLS) == {FALLBACK_CLUSTER, cluster_name("chat"), *pool_clusters("code", 2)}
    assert consistency_problems(eds_names(clusters), endpoints, routed_clusters(POOLS), clusters) == []


def test_each_problem_is_named() -> None:
    clusters = Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS[:1]))
    endpoints = Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS[1:], []))
    problems = consistency_problems(eds_names(clusters), endpoints, routed_clusters(POOLS), clusters)
    assert f"cluster {cluster_name('chat')} has no load assignment" in problems
    assert any(p.startswith("load assignment pool-code") and p.endswith("has no cluster") for p in problems)
    assert [p for p in problems if p.startswith("route's")] == [
        f"route's cluster {name} is not served" for name in pool_clusters("code", 2)]


def test_an_assignment_without_its_cluster_is_not_published_and_the_last_good_one_stays(
        caplog: pytest.LogCaptureFixture) -> None:
    snapshots, cache, told = fleet_snapshots()
    version = snapshots.update([W1])
    assert told == [(CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL)]
    good = published(cache)
    stray = Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints((PoolSpec(name="gone", model="x"),), []))
    with caplog.at_level(logging.ERROR, logger="controller.xds"):
        served = snapshots._publish([good[0], good[1].replaced([stray.resources[cluster_name("gone")]])])
    assert served == version == cache.version() and published(cache) == good
    assert len(told) == 1 and snapshots.refused == 1  # no stream was woken
    [record] = caplog.records
    assert record.levelno == logging.ERROR and "load assignment pool-gone has no cluster" in record.getMessage()
    assert snapshots.update([W1, W2]) != version and len(told) == 2  # the next good snapshot goes out


def test_a_route_left_without_its_cluster_is_not_published(caplog: pytest.LogCaptureFixture) -> None:
    # Clusters and assignments agree, but the fallback route's cluster is gone: Envoy would accept it (its
    # route table does not validate clusters) and answer every fail-open request 503.
    snapshots, cache, told = fleet_snapshots()
    version = snapshots.update([W1])
    good_clusters, good_endpoints = published(cache)
    kept = [c for c in build_clusters(POOLS) if c.name != FALLBACK_CLUSTER]
    endpoints = Snapshot.of(ENDPOINT_TYPE_URL, [good_endpoints.resources[name] for name in good_endpoints.wires
                                                if name != FALLBACK_CLUSTER])
    with caplog.at_level(logging.ERROR, logger="controller.xds"):
        assert snapshots._publish([Snapshot.of(CLUSTER_TYPE_URL, kept), endpoints]) == version
    assert published(cache) == (good_clusters, good_endpoints) and len(told) == 1
    assert f"route's cluster {FALLBACK_CLUSTER} is not served" in caplog.text


def test_an_envoy_is_never_sent_a_refused_snapshot() -> None:
    # The wiring of ``XdsServer``: what the snapshots publish wakes the streams, which answer from the cache.
    cache = SnapshotCache()
    pushed: list[discovery_pb2.DiscoveryResponse] = []
    stream = AdsStream(cache)
    snapshots = FleetSnapshots(POOLS, cache, lambda changed: pushed.extend(stream.on_change(changed)))
    snapshots.update([W1])
    [first] = stream.on_request(discovery_pb2.DiscoveryRequest(type_url=ENDPOINT_TYPE_URL,
                                                               resource_names=[cluster_name("chat")]))
    assert not stream.on_request(discovery_pb2.DiscoveryRequest(
        type_url=ENDPOINT_TYPE_URL, resource_names=[cluster_name("chat")], version_info=first.version_info,
        response_nonce=first.nonce))
    clusters, endpoints = published(cache)
    emptied = endpoints.replaced(build_endpoints(POOLS[:1], []))  # chat's worker gone, but with a stray too
    snapshots._publish([clusters, emptied.replaced(build_endpoints((PoolSpec(name="gone", model="x"),), []))])
    assert pushed == [] and snapshots.refused == 1
    snapshots.update([W1, W2])
    [push] = pushed
    assert push.version_info != first.version_info and len(push.resources) == 1


def test_every_refusal_is_counted_on_the_controllers_metrics_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    server = XdsServer(POOLS)
    registry = CollectorRegistry()
    XdsMetrics(server, registry)
    server.update([W1])
    assert registry.get_sample_value("poolgate_xds_snapshots_refused_total") == 0
    broken = Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints((PoolSpec(name="gone", model="x"),), []))
    with caplog.at_level(logging.ERROR, logger="controller.xds"):
        for _ in range(3):  # a build bug refuses every update after it: one error line, not one per update
            server._publish([broken])
    assert server.snapshots_refused == 3
    assert registry.get_sample_value("poolgate_xds_snapshots_refused_total") == 3
    assert len(caplog.records) == 1
