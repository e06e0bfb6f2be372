"""Snapshots: version = content hash, changes only when content changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.xds.build import CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL, build_clusters, build_endpoints
from controller.xds.cache import Snapshot, SnapshotCache
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState

POOLS = (PoolSpec(name="chat", model="llama"),)
W1 = WorkerRecord(id="w1", pool="chat", model="llama", host="10.0.0.1", port=8000)
W2 = WorkerRecord(id="w2", pool="chat", model="llama", host="10.0.0.2", port=8000)


def endpoints(*workers: WorkerRecord) -> Snapshot:
    return Snapshot.of(ENDPOINT_TYPE_URL, build_endpoints(POOLS, workers))


def test_same_content_same_version() -> None:
    assert endpoints(W1, W2).version == endpoints(W2, W1).version


def test_live_facts_that_envoy_does_not_see_keep_the_version() -> None:
    busy = replace(W1, kv_usage=0.9, running=12, updated_at=W1.updated_at + 5)
    assert endpoints(W1).version == endpoints(busy).version


@pytest.mark.parametrize("changed", [
    replace(W1, state=WorkerState.DRAINING),
    replace(W1, port=8001),
    replace(W1, id="w9"),
])
def test_content_change_changes_the_version(changed: WorkerRecord) -> None:
    assert endpoints(W1).version != endpoints(changed).version


def test_cache_reports_changed_types_only() -> None:
    cache = SnapshotCache()
    clusters = Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS))
    assert cache.set([clusters, endpoints(W1)]) == [CLUSTER_TYPE_URL, ENDPOINT_TYPE_URL]
    first = cache.version()
    assert cache.set([Snapshot.of(CLUSTER_TYPE_URL, build_clusters(POOLS)), endpoints(W1)]) == []
    assert cache.version() == first
    assert cache.set([clusters, endpoints(W1, W2)]) == [ENDPOINT_TYPE_URL]
    assert cache.version() != first


def test_select_by_name_and_wildcard() -> None:
    snapshot = endpoints(W1)
    assert [r.cluster_name for r in snapshot.select(None)] == ["pool-chat", "poolgate-fallback"]
    assert [r.cluster_name for r in snapshot.select(frozenset({"pool-chat", "missing"}))] == ["pool-chat"]


def test_duplicate_names_are_refused() -> None:
    clusters = build_clusters(POOLS)
    with pytest.raises(ValueError, match="share a name"):
        Snapshot.of(CLUSTER_TYPE_URL, clusters + clusters[:1])
