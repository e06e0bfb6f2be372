"""The per-stream ADS state machine: first answers, ACK, NACK, stale nonces, subscriptions, pushes."""

from __future__ import annotations

import logging

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, build_clusters, build_endpoints
from controller.xds.cache import Snapshot, SnapshotCache
from controller.xds.server import AdsStream
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder"))
W1 = WorkerRecord(id="w1", pool="chat", model="llama", host="10.0.0.1", port=8000)
W2 = WorkerRecord(id="w2", pool="code", model="coder", host="10.0.0.2", port=8000)


def make_cache(*workers: WorkerRecord) -> SnapshotCache:
    cache = SnapshotCache()
    cache.set([Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS)),
               Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS, workers))])
    return cache


def version(cache: SnapshotCache, type_url: str) -> str:
    snapshot = cache.get(type_url)
    assert snapshot is not None
    return snapshot.version


def request(type_url: str, names: tuple[str, ...] = (), nonce: str = "", version: str = "",
            error: str | None = None, node: str = "") -> discovery_pb2.DiscoveryRequest:
    message = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names, response_nonce=nonce,
                                             version_info=version)
    message.node.id = node
    if error is not None:
        message.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return message


def names_of(response: discovery_pb2.DiscoveryResponse) -> list[str]:
    out = []
    for packed in response.resources:
        if packed.Is(cluster_pb2.Cluster.DESCRIPTOR):
            cluster = cluster_pb2.Cluster()
            packed.Unpack(cluster)
            out.append(cluster.name)
        else:
            assignment = endpoint_pb2.ClusterLoadAssignment()
            packed.Unpack(assignment)
            out.append(assignment.cluster_name)
    return out


def test_first_cds_request_gets_every_cluster() -> None:
    cache = make_cache()
    stream = AdsStream(cache)
    [response] = stream.on_request(request(CLUSTER_TYPE_URL, node="envoy-1"))
    assert stream.node_id == "envoy-1"
    assert response.type_url == CLUSTER_TYPE_URL
    assert response.version_info == version(cache, CLUSTER_TYPE_URL)
    assert response.nonce
    assert names_of(response) == ["pool-chat", "pool-code", "poolgate-fallback"]


def test_eds_answers_only_the_subscribed_names() -> None:
    stream = AdsStream(make_cache(W1, W2))
    [response] = stream.on_request(request(ENDPOINT_TYPE_URL, ("pool-code",)))
    assert names_of(response) == ["pool-code"]


def test_ack_records_version_and_sends_nothing() -> None:
    stream = AdsStream(make_cache())
    [response] = stream.on_request(request(CLUSTER_TYPE_URL))
    assert stream.on_request(request(CLUSTER_TYPE_URL, nonce=response.nonce, version=response.version_info)) == []
    assert stream.subscriptions[CLUSTER_TYPE_URL].acked_version == response.version_info


def test_nack_is_logged_kept_and_not_resent(caplog: pytest.LogCaptureFixture) -> None:
    cache = make_cache()
    stream = AdsStream(cache)
    [first] = stream.on_request(request(ENDPOINT_TYPE_URL, ("pool-chat",), node="envoy-1"))
    stream.on_request(request(ENDPOINT_TYPE_URL, ("pool-chat",), nonce=first.nonce, version=first.version_info))
    cache.set([Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS, [W1]))])
    [second] = stream.on_change([ENDPOINT_TYPE_URL])
    with caplog.at_level(logging.ERROR, logger="controller.xds.server"):
        nack = request(ENDPOINT_TYPE_URL, ("pool-chat",), nonce=second.nonce, version=first.version_info,
                       error="malformed endpoint")
        assert stream.on_request(nack) == []
    assert "malformed endpoint" in caplog.text and "envoy-1" in caplog.text
    subscription = stream.subscriptions[ENDPOINT_TYPE_URL]
    assert subscription.acked_version == first.version_info  # Envoy keeps the last good version
    assert subscription.last_error == "malformed endpoint"
    assert stream.on_change([ENDPOINT_TYPE_URL]) == []  # same content: no resend loop
    cache.set([Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS, [W1, W2]))])
    [third] = stream.on_change([ENDPOINT_TYPE_URL])  # a new version is offered again
    assert third.version_info == version(cache, ENDPOINT_TYPE_URL)


def test_stale_nonce_is_ignored() -> None:
    cache = make_cache()
    stream = AdsStream(cache)
    [first] = stream.on_request(request(CLUSTER_TYPE_URL))
    cache.set([Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS[:1]))])
    [second] = stream.on_change([CLUSTER_TYPE_URL])
    late_ack = request(CLUSTER_TYPE_URL, nonce=first.nonce, version=first.version_info)
    assert stream.on_request(late_ack) == []
    assert stream.subscriptions[CLUSTER_TYPE_URL].acked_version == ""
    assert stream.subscriptions[CLUSTER_TYPE_URL].sent_nonce == second.nonce


def test_new_eds_names_are_answered_even_without_a_new_version() -> None:
    stream = AdsStream(make_cache(W1, W2))
    [first] = stream.on_request(request(ENDPOINT_TYPE_URL, ("pool-chat",)))
    [again] = stream.on_request(request(ENDPOINT_TYPE_URL, ("pool-chat", "pool-code"), nonce=first.nonce,
                                        version=first.version_info))
    assert names_of(again) == ["pool-chat", "pool-code"]
    assert again.nonce != first.nonce


def test_changes_push_only_subscribed_types_and_clusters_first() -> None:
    cache = make_cache()
    stream = AdsStream(cache)
    assert stream.on_change([CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL]) == []  # nothing subscribed yet
    stream.on_request(request(CLUSTER_TYPE_URL))
    stream.on_request(request(ENDPOINT_TYPE_URL, ("pool-chat",)))
    assert stream.on_change([CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL]) == []  # versions already sent
    cache.set([Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS[:1])),
               Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS[:1], [W1]))])
    responses = stream.on_change([ENDPOINT_TYPE_URL, CLUSTER_TYPE_URL])
    assert [r.type_url for r in responses] == [CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL]


def test_reconnect_gets_an_answer_even_with_the_current_version() -> None:
    cache = make_cache()
    stream = AdsStream(cache)
    current = version(cache, CLUSTER_TYPE_URL)
    [response] = stream.on_request(request(CLUSTER_TYPE_URL, version=current))
    assert response.version_info == current


def test_unserved_type_is_ignored() -> None:
    stream = AdsStream(make_cache())
    assert stream.on_request(request("type.googleapis.com/envoy.config.listener.v3.Listener")) == []


def test_a_stream_opened_before_the_first_fleet_read_waits_for_it() -> None:
    """A reconnecting Envoy asks for both types at once; before the cache holds the fleet it gets nothing
    (it keeps its endpoints), and the first snapshot answers both requests with every resource."""
    cache = SnapshotCache()
    stream = AdsStream(cache)
    assert stream.on_request(request(CLUSTER_TYPE_URL, version="old")) == []
    assert stream.on_request(request(ENDPOINT_TYPE_URL, ("pool-chat", "pool-code"), version="old")) == []
    filled = make_cache(W1, W2)
    cache.set([s for s in (filled.get(CLUSTER_TYPE_URL), filled.get(ENDPOINT_TYPE_URL)) if s is not None])
    cds, eds = stream.on_change([CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL])
    assert names_of(cds) == ["pool-chat", "pool-code", "poolgate-fallback"]
    assert names_of(eds) == ["pool-chat", "pool-code"]
