"""The per-stream delta ADS state machine: only what Envoy lacks is sent, removals, reconnects, ACK, NACK."""

from __future__ import annotations

import logging

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, build_clusters, build_endpoints
from controller.xds.cache import Snapshot, SnapshotCache
from controller.xds.delta import DeltaAdsStream
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import FALLBACK_CLUSTER, cluster_name

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder"))
W1 = WorkerRecord(id="w1", pool="chat", model="llama", host="10.0.0.1", port=8000)
W2 = WorkerRecord(id="w2", pool="code", model="coder", host="10.0.0.2", port=8000)
EDS_NAMES = (cluster_name("chat"), cluster_name("code"), FALLBACK_CLUSTER)


def make_cache(*workers: WorkerRecord) -> SnapshotCache:
    cache = SnapshotCache()
    set_fleet(cache, *workers)
    return cache


def set_fleet(cache: SnapshotCache, *workers: WorkerRecord) -> list[str]:
    return cache.set([Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS)),
                      Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS, workers))])


def request(type_url: str, subscribe: tuple[str, ...] = (), unsubscribe: tuple[str, ...] = (), nonce: str = "",
            error: str | None = None, initial: dict[str, str] | None = None) -> discovery_pb2.DeltaDiscoveryRequest:
    message = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url, resource_names_subscribe=subscribe, resource_names_unsubscribe=unsubscribe,
        response_nonce=nonce, initial_resource_versions=initial or {})
    if error is not None:
        message.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return message


def names(response: discovery_pb2.DeltaDiscoveryResponse) -> list[str]:
    return [resource.name for resource in response.resources]


def connected(cache: SnapshotCache) -> DeltaAdsStream:
    """A stream that holds every cluster and subscribed every load assignment, all acknowledged."""
    stream = DeltaAdsStream(cache)
    [clusters] = stream.on_request(request(CLUSTER_TYPE_URL))
    assert stream.on_request(request(CLUSTER_TYPE_URL, nonce=clusters.nonce)) == []
    [endpoints] = stream.on_request(request(ENDPOINT_TYPE_URL, subscribe=EDS_NAMES))
    assert stream.on_request(request(ENDPOINT_TYPE_URL, nonce=endpoints.nonce)) == []
    return stream


def test_first_cluster_request_naming_nothing_is_the_wildcard() -> None:
    stream = DeltaAdsStream(make_cache(W1))
    [response] = stream.on_request(request(CLUSTER_TYPE_URL))
    assert sorted(names(response)) == sorted(EDS_NAMES)
    assert all(resource.version for resource in response.resources)
    assert response.type_url == CLUSTER_TYPE_URL and response.nonce and response.system_version_info


def test_endpoints_are_sent_only_for_the_names_subscribed() -> None:
    stream = DeltaAdsStream(make_cache(W1, W2))
    assert stream.on_request(request(ENDPOINT_TYPE_URL)) == []  # no names: EDS has no wildcard
    [response] = stream.on_request(request(ENDPOINT_TYPE_URL, subscribe=(cluster_name("chat"),)))
    assert names(response) == [cluster_name("chat")]
    assignment = endpoint_pb2.ClusterLoadAssignment()
    response.resources[0].resource.Unpack(assignment)
    assert [e.endpoint.hostname for e in assignment.endpoints[0].lb_endpoints] == ["w1"]


def test_one_workers_change_sends_only_its_pools_assignment() -> None:
    cache = make_cache(W1, W2)
    stream = connected(cache)
    changed = set_fleet(cache, W1, W2.with_live(state=WorkerState.DRAINING))
    assert changed == [ENDPOINT_TYPE_URL]
    [response] = stream.on_change(changed)
    assert names(response) == [cluster_name("code"), FALLBACK_CLUSTER]
    assert response.removed_resources == []


def test_an_ack_sends_nothing_and_records_the_version() -> None:
    cache = make_cache(W1)
    stream = connected(cache)
    [response] = stream.on_change(set_fleet(cache, W1, W2))
    assert stream.on_request(request(ENDPOINT_TYPE_URL, nonce=response.nonce)) == []
    assert stream.subscriptions[ENDPOINT_TYPE_URL].acked_version == response.system_version_info
    assert stream.on_change([ENDPOINT_TYPE_URL]) == []  # nothing new since


def test_reconnect_declaring_current_versions_gets_nothing_again() -> None:
    cache = make_cache(W1, W2)
    held = {name: version for name, version in cache.get(ENDPOINT_TYPE_URL).versions.items()}  # type: ignore[union-attr]
    stream = DeltaAdsStream(cache)
    stale = dict(held, **{cluster_name("chat"): "old"})
    [response] = stream.on_request(request(ENDPOINT_TYPE_URL, subscribe=EDS_NAMES, initial=stale))
    assert names(response) == [cluster_name("chat")]  # only the one it holds at another version
    fresh = DeltaAdsStream(cache)
    assert fresh.on_request(request(ENDPOINT_TYPE_URL, subscribe=EDS_NAMES, initial=held)) == []
    assert fresh.subscriptions[ENDPOINT_TYPE_URL].acked_version == cache.get(ENDPOINT_TYPE_URL).version  # type: ignore[union-attr]


def test_a_resource_that_is_gone_is_named_removed() -> None:
    cache = SnapshotCache()
    cache.set([Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS))])
    stream = DeltaAdsStream(cache)
    stream.on_request(request(CLUSTER_TYPE_URL))
    cache.set([Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS[:1]))])
    [response] = stream.on_change([CLUSTER_TYPE_URL])
    assert names(response) == [] and response.removed_resources == [cluster_name("code")]
    assert stream.on_change([CLUSTER_TYPE_URL]) == []  # said once


def test_unsubscribed_names_are_not_pushed_and_a_new_subscription_is_answered() -> None:
    cache = make_cache(W1, W2)
    stream = connected(cache)
    assert stream.on_request(request(ENDPOINT_TYPE_URL, unsubscribe=(cluster_name("code"),))) == []
    assert stream.on_change(set_fleet(cache, W1, W2.with_live(state=WorkerState.DRAINING))) != []
    [again] = stream.on_request(request(ENDPOINT_TYPE_URL, subscribe=(cluster_name("code"),)))
    assert names(again) == [cluster_name("code")]  # it dropped it: sent whole, version unchanged or not


def test_nack_keeps_serving_and_offers_the_rejected_resources_again(caplog: pytest.LogCaptureFixture) -> None:
    cache = make_cache(W1)
    stream = connected(cache)
    [response] = stream.on_change(set_fleet(cache, W1, W2))
    with caplog.at_level(logging.ERROR):
        assert stream.on_request(request(ENDPOINT_TYPE_URL, nonce=response.nonce, error="bad endpoint")) == []
    assert any("rejected ClusterLoadAssignment" in r.getMessage() for r in caplog.records)
    subscription = stream.subscriptions[ENDPOINT_TYPE_URL]
    assert subscription.last_error == "bad endpoint"
    assert subscription.acked_version != response.system_version_info
    [retry] = stream.on_change(set_fleet(cache, W1, W2.with_live(state=WorkerState.DRAINING)))
    assert sorted(names(retry)) == sorted(names(response))  # the rejected ones again, with the new change


def test_an_answer_to_an_unknown_nonce_changes_nothing() -> None:
    cache = make_cache(W1)
    stream = connected(cache)
    acked = stream.subscriptions[ENDPOINT_TYPE_URL].acked_version
    assert stream.on_request(request(ENDPOINT_TYPE_URL, nonce="999", error="old")) == []
    assert stream.subscriptions[ENDPOINT_TYPE_URL].acked_version == acked
    assert stream.subscriptions[ENDPOINT_TYPE_URL].last_error == ""


def test_unserved_type_is_ignored() -> None:
    stream = DeltaAdsStream(make_cache())
    assert stream.on_request(request("type.googleapis.com/envoy.config.listener.v3.Listener")) == []
