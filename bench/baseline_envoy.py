"""An Envoy bootstrap for the baseline policies: plain Envoy load balancing, no ext_proc, no xDS.

One STATIC cluster per (pool, policy) with the known worker addresses and that policy's ``lb_policy``;
``least_request_weighted`` gives each endpoint its ``load_balancing_weight`` (what a careful operator sets
from each worker's measured capacity: Envoy's weighted least request then picks by
``weight / (active_requests + 1)``), the others ignore weights.
Plain Envoy cannot read the model from the body, so the client names the cluster in a benchmark-only
header (``BENCH_CLUSTER_HEADER``, deliberately not one of poolgate's routing headers) and the single route
follows it. Timeouts and circuit breakers match poolgate's Envoy so only the choice of worker differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from controller.xds.build import CIRCUIT_LIMIT, CONNECT_TIMEOUT_S
from poolgate.kernel.routing import ROUTING_HEADERS

BENCH_CLUSTER_HEADER = "x-bench-cluster"
assert BENCH_CLUSTER_HEADER not in ROUTING_HEADERS

LB_POLICIES = {"round_robin": "ROUND_ROBIN", "least_request": "LEAST_REQUEST", "random": "RANDOM",
               "least_request_weighted": "LEAST_REQUEST"}
WEIGHTED = {"least_request_weighted"}
Endpoint = tuple[str, int, int]
"""(host, port, weight)."""
MAX_BODY_BYTES = 16 * 1024 * 1024 + 64 * 1024


def baseline_cluster(pool: str, policy: str) -> str:
    return f"bench-{pool}-{policy}"


def _endpoint(host: str, port: int, weight: int | None) -> dict[str, Any]:
    endpoint: dict[str, Any] = {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
    if weight is not None:
        endpoint["load_balancing_weight"] = max(1, weight)
    return endpoint


def _cluster(name: str, lb_policy: str, endpoints: Sequence[Endpoint], weighted: bool) -> dict[str, Any]:
    limit = {"max_connections": CIRCUIT_LIMIT, "max_pending_requests": CIRCUIT_LIMIT,
             "max_requests": CIRCUIT_LIMIT, "max_retries": CIRCUIT_LIMIT}
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": f"{CONNECT_TIMEOUT_S}s",
        "lb_policy": lb_policy,
        "circuit_breakers": {"thresholds": [limit]},
        "common_lb_config": {"healthy_panic_threshold": {"value": 0.0}},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            _endpoint(host, port, weight if weighted else None) for host, port, weight in endpoints
        ]}]},
    }


def baseline_bootstrap(pools: Mapping[str, Sequence[Endpoint]], *, listen_port: int,
                       admin_port: int) -> dict[str, Any]:
    """``pools`` maps pool name → worker endpoints; every pool gets one cluster per ``LB_POLICIES`` entry."""
    clusters = [_cluster(baseline_cluster(pool, policy), lb, endpoints, policy in WEIGHTED)
                for pool, endpoints in pools.items() for policy, lb in LB_POLICIES.items()]
    route = {"match": {"prefix": "/"}, "route": {"cluster_header": BENCH_CLUSTER_HEADER, "timeout": "0s"}}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "bench",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "route_config": {"name": "bench", "virtual_hosts": [{"name": "bench", "domains": ["*"], "routes": [route]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    listener = {
        "name": "bench-http",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        "per_connection_buffer_limit_bytes": MAX_BODY_BYTES,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": manager}]}],
    }
    return {
        "node": {"id": "bench-baseline", "cluster": "bench"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [listener], "clusters": clusters},
    }
