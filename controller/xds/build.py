"""Fleet state → Envoy resources (CDS clusters, EDS load assignments). Pure functions, no I/O.

One cluster per pool, named ``cluster_name(pool)`` (or ``endpoint_shards`` of them, ``pool_clusters``), whose
endpoints come from EDS over ADS. Its load
balancer is ``override_host``: extproc pins the worker through dynamic metadata (never a header, which a
client could set), and ``least_request`` picks when no pin is present. The fallback cluster holds every
worker of every pool for the fail-open route used while extproc is away.
"""

from __future__ import annotations

from collections.abc import Sequence

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import percent_pb2
from google.protobuf import duration_pb2
from google.protobuf.wrappers_pb2 import UInt32Value

from controller.xds.endpoint_table import EndpointTable
from controller.xds.envoy_tls import client_sides, upstream_tls
from poolgate.kernel.config import PoolSpec, TlsSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import DESTINATION_ENDPOINT_KEY, FALLBACK_CLUSTER, LB_METADATA_NAMESPACE, pool_clusters

CLUSTER_TYPE_URL = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
SERVED_TYPES = (CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL)
"""In push order: clusters before their endpoints, as ADS expects."""


def short_type(type_url: str) -> str:
    """``Cluster`` for the cluster type URL: for logs."""
    return type_url.rsplit(".", 1)[-1]

OVERRIDE_HOST_POLICY = "envoy.load_balancing_policies.override_host"
LEAST_REQUEST_POLICY = "envoy.load_balancing_policies.least_request"

CONNECT_TIMEOUT_S = 2

CIRCUIT_LIMIT = 100_000
"""Envoy's defaults (1024 requests/connections, 3 concurrent retries per cluster) cut long SSE streams and
held requests short; poolgate admits and queues in extproc, so Envoy's breakers only guard against runaway."""

OUTLIER_LOCAL_ORIGIN_FAILURES = 2
"""Connect failures, timeouts and resets in a row (Envoy's own view) that eject a host: a killed worker
leaves rotation after two refused connections, long before the controller's probes notice."""
OUTLIER_CONSECUTIVE_5XX = 5
OUTLIER_BASE_EJECTION_S = 5
OUTLIER_MAX_EJECTION_PERCENT = 50
"""Never eject more than half a pool on passive evidence alone; the probes decide about the rest."""


def outlier_detection() -> outlier_detection_pb2.OutlierDetection:
    """Passive health in Envoy: a pool's failing host leaves rotation on the next failure, not the next probe.

    Local-origin errors (connect failure, reset, timeout) count apart from the worker's own 5xx answers, so a
    dead process is ejected after ``OUTLIER_LOCAL_ORIGIN_FAILURES`` attempts while a model that answers a few
    500s needs ``OUTLIER_CONSECUTIVE_5XX`` in a row. Success-rate ejection stays off (pools are small).
    """
    return outlier_detection_pb2.OutlierDetection(
        split_external_local_origin_errors=True,
        consecutive_local_origin_failure=UInt32Value(value=OUTLIER_LOCAL_ORIGIN_FAILURES),
        enforcing_consecutive_local_origin_failure=UInt32Value(value=100),
        consecutive_5xx=UInt32Value(value=OUTLIER_CONSECUTIVE_5XX),
        enforcing_consecutive_5xx=UInt32Value(value=100),
        enforcing_success_rate=UInt32Value(value=0),
        enforcing_local_origin_success_rate=UInt32Value(value=0),
        interval=duration_pb2.Duration(seconds=1),
        base_ejection_time=duration_pb2.Duration(seconds=OUTLIER_BASE_EJECTION_S),
        max_ejection_percent=UInt32Value(value=OUTLIER_MAX_EJECTION_PERCENT),
    )


def relaxed_circuit_breakers() -> circuit_breaker_pb2.CircuitBreakers:
    breakers = circuit_breaker_pb2.CircuitBreakers()
    breakers.thresholds.add(
        max_connections=UInt32Value(value=CIRCUIT_LIMIT),
        max_pending_requests=UInt32Value(value=CIRCUIT_LIMIT),
        max_requests=UInt32Value(value=CIRCUIT_LIMIT),
        max_retries=UInt32Value(value=CIRCUIT_LIMIT),
    )
    return breakers


def _least_request() -> cluster_pb2.LoadBalancingPolicy:
    policy = cluster_pb2.LoadBalancingPolicy()
    entry = policy.policies.add()
    entry.typed_extension_config.name = LEAST_REQUEST_POLICY
    entry.typed_extension_config.typed_config.Pack(least_request_pb2.LeastRequest())
    return policy


def _override_host() -> cluster_pb2.LoadBalancingPolicy:
    pin = metadata_pb2.MetadataKey(
        key=LB_METADATA_NAMESPACE,
        path=[metadata_pb2.MetadataKey.PathSegment(key=DESTINATION_ENDPOINT_KEY)],
    )
    config = override_host_pb2.OverrideHost(
        override_host_sources=[override_host_pb2.OverrideHost.OverrideHostSource(metadata=pin)],
        fallback_policy=_least_request(),
    )
    policy = cluster_pb2.LoadBalancingPolicy()
    entry = policy.policies.add()
    entry.typed_extension_config.name = OVERRIDE_HOST_POLICY
    entry.typed_extension_config.typed_config.Pack(config)
    return policy


def _eds_cluster(name: str, policy: cluster_pb2.LoadBalancingPolicy) -> cluster_pb2.Cluster:
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.EDS,
        connect_timeout=duration_pb2.Duration(seconds=CONNECT_TIMEOUT_S),
        load_balancing_policy=policy,
        circuit_breakers=relaxed_circuit_breakers(),
    )
    cluster.eds_cluster_config.eds_config.ads.SetInParent()
    cluster.eds_cluster_config.eds_config.resource_api_version = config_source_pb2.V3
    # 0 disables panic mode: with the default 50 %, Envoy spreads over unhealthy hosts when few are left.
    cluster.common_lb_config.healthy_panic_threshold.CopyFrom(percent_pb2.Percent(value=0.0))
    return cluster


def build_clusters(pools: Sequence[PoolSpec], tls: TlsSettings | None = None) -> list[cluster_pb2.Cluster]:
    """One override_host cluster per pool or pool shard (with outlier detection), plus the least_request
    fallback cluster; with ``tls.workers`` every one reaches its workers over TLS, its certificate files read
    through SDS."""
    clusters = [_eds_cluster(name, _override_host())
                for pool in pools for name in pool_clusters(pool.name, pool.endpoint_shards)]
    for cluster in clusters:
        cluster.outlier_detection.CopyFrom(outlier_detection())
    clusters.append(_eds_cluster(FALLBACK_CLUSTER, _least_request()))
    _, workers = client_sides(tls) if tls is not None else (None, None)
    if workers is not None:
        for cluster in clusters:
            cluster.transport_socket.CopyFrom(upstream_tls(workers))
    return clusters


def build_endpoints(
    pools: Sequence[PoolSpec], workers: Sequence[WorkerRecord]
) -> list[endpoint_pb2.ClusterLoadAssignment]:
    """One load assignment per cluster (empty when it has no workers) and one for the fallback cluster, built
    at once (the xDS server keeps an ``EndpointTable`` and rebuilds only what changed).

    Output order does not depend on input order, so equal fleets give byte-equal resources. Workers of
    unknown pools, bad ports, and hosts that are not IP literals are left out (``EndpointTable``).
    """
    table = EndpointTable(pools)
    table.apply({worker.id: worker for worker in workers})
    return [endpoint_pb2.ClusterLoadAssignment.FromString(encoded.wire)
            for encoded in [*(table.assignment(cluster) for cluster in table.clusters), table.fallback()]]
