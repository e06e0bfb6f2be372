"""Names that Envoy's config (built by the controller) and extproc's answers must agree on."""

from __future__ import annotations

import zlib

CLUSTER_HEADER = "x-poolgate-cluster"
"""Set by extproc; the route reads the pool's cluster from it. Client-sent copies are stripped."""

DESTINATION_ENDPOINT_KEY = "x-gateway-destination-endpoint"
"""Gateway API Inference Extension key for the picked ``ip:port`` (comma list = ordered fallbacks)."""

LB_METADATA_NAMESPACE = "envoy.lb"
"""Dynamic metadata namespace the override_host policy reads the pin from (metadata only, never headers)."""

WORKER_HEADER = "x-poolgate-worker"
"""Response header naming the worker that served a request (set by the worker itself)."""

FALLBACK_CLUSTER = "poolgate-fallback"
"""Every Ready worker; used by the fail-open default route when extproc is away."""

QUEUE_WAIT_HEADER = "x-poolgate-queue-wait-ms"
"""Set by extproc on a request it held (for capacity or a cold start): milliseconds it waited; the access log
reads it."""

PREFILL_HEADER = "x-poolgate-prefill"
DECODE_HEADER = "x-poolgate-decode"
"""Set by extproc on a disaggregated request: the prefill and the decode worker (``ip:port`` comma lists, best
first) the sidecar runs the two steps on. Client-sent copies are stripped like every routing header."""

PD_SIDECAR_CLUSTER = "poolgate-pd-sidecar"
"""The static cluster of the prefill/decode sidecar; extproc names it in the cluster header."""

ROUTING_HEADERS = (CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY, "x-poolgate-tenant", "x-poolgate-pool",
                   "x-poolgate-endpoint", PREFILL_HEADER, DECODE_HEADER,
                   QUEUE_WAIT_HEADER)
"""Headers a client must never be able to set: Envoy removes them before ext_proc, extproc again."""


def cluster_name(pool: str) -> str:
    """The Envoy cluster (and EDS resource) name of a pool."""
    return f"pool-{pool}"


def pool_clusters(pool: str, shards: int = 1) -> tuple[str, ...]:
    """The Envoy clusters a pool's workers are split over (``PoolSpec.endpoint_shards``): its own cluster
    alone, or ``pool-<name>.<k>`` for k < shards (a dot, which pool names lack, so no two pools' names meet)."""
    if shards <= 1:
        return (cluster_name(pool),)
    return tuple(_shard_cluster(pool, index) for index in range(shards))


def worker_cluster(pool: str, worker_id: str, shards: int = 1) -> str:
    """The one cluster of ``pool_clusters`` that holds a worker: chosen by a hash of its id alone, so the
    controller (which builds the clusters) and extproc (which names one per request) agree without asking."""
    if shards <= 1:
        return cluster_name(pool)
    return _shard_cluster(pool, zlib.crc32(worker_id.encode()) % shards)


def _shard_cluster(pool: str, index: int) -> str:
    return f"{cluster_name(pool)}.{index}"
