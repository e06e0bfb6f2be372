"""Envoy's side of health: outlier detection on pool clusters, retries only before the request started."""

from __future__ import annotations

from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2

from controller.xds.bootstrap import build_bootstrap
from controller.xds.build import build_clusters
from poolgate.kernel.config import PoolSpec, parse_config
from poolgate.kernel.routing import FALLBACK_CLUSTER

POOLS = (PoolSpec(name="chat", model="m"),)


def test_pool_clusters_eject_failing_hosts_passively() -> None:
    clusters = {c.name: c for c in build_clusters(POOLS)}
    outlier = clusters["pool-chat"].outlier_detection
    assert outlier.split_external_local_origin_errors
    assert outlier.consecutive_local_origin_failure.value == 2
    assert outlier.enforcing_consecutive_local_origin_failure.value == 100
    assert outlier.max_ejection_percent.value == 50
    assert not clusters[FALLBACK_CLUSTER].HasField("outlier_detection")


def test_pool_route_retries_on_another_host_only_before_the_response_started() -> None:
    config = parse_config({"pools": [{"name": "chat", "model": "m"}]})
    bootstrap = build_bootstrap(config, node_id="n", listen_port=1, admin_port=2, extproc_port=3, xds_port=4)
    manager = hcm_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(manager)
    pool_route = manager.route_config.virtual_hosts[0].routes[0]
    policy = pool_route.route.retry_policy
    assert set(policy.retry_on.split(",")) == {"connect-failure", "refused-stream", "reset"}
    assert "5xx" not in policy.retry_on and "gateway-error" not in policy.retry_on
    assert policy.num_retries.value == 2
    assert [p.name for p in policy.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]
