"""The endpoint table kept one change at a time gives the resources a build of the whole fleet gives."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from controller.xds import XdsServer
from controller.xds.build import ENDPOINT_TYPE_URL, build_endpoints
from controller.xds.endpoint_table import EndpointTable
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.routing import FALLBACK_CLUSTER, cluster_name, pool_clusters, worker_cluster

POOLS = (PoolSpec(name="chat", model="m"), PoolSpec(name="code", model="m"),
         PoolSpec(name="long", model="m", endpoint_shards=3))


def worker(index: int, rng: random.Random) -> WorkerRecord:
    return WorkerRecord(id=f"w{index:03d}", pool=rng.choice([*(p.name for p in POOLS), "gone-pool"]), model="m",
                        host=rng.choice(["10.0.0.1", "10.0.0.2", "::1", "not-an-ip"]),
                        port=rng.choice([8000, 8001, 8002, 0]), state=rng.choice(list(WorkerState)))


def table_resources(table: EndpointTable) -> list[bytes]:
    """The wire form the table sends as it is: byte-equal to what serializing the built messages gives."""
    return [a.wire for a in [*(table.assignment(c) for p in POOLS for c in pool_clusters(p.name, p.endpoint_shards)),
                             table.fallback()]]


def built_resources(fleet: dict[str, WorkerRecord]) -> list[bytes]:
    return [a.SerializeToString(deterministic=True) for a in build_endpoints(POOLS, list(fleet.values()))]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("named", [True, False], ids=["delta", "whole"])
def test_changes_applied_one_by_one_match_a_build_of_the_whole_fleet(seed: int, named: bool) -> None:
    """Joins, leaves, state, address and pool changes, duplicate addresses and unusable workers, applied as
    deltas (the ids named) or as whole fleets: after every step each cluster's (a pool's, or a shard's of the
    sharded pool) and the fallback's assignment equals the one built from scratch."""
    rng = random.Random(seed)
    fleet = {w.id: w for w in (worker(i, rng) for i in range(40))}
    table = EndpointTable(POOLS)
    table.apply(fleet)
    assert table_resources(table) == built_resources(fleet)
    for _ in range(150):
        changed = set()
        for _ in range(rng.randint(1, 4)):
            index = rng.randrange(60)
            worker_id = f"w{index:03d}"
            if worker_id in fleet and rng.random() < 0.3:
                del fleet[worker_id]
            elif worker_id in fleet and rng.random() < 0.5:
                fleet[worker_id] = replace(fleet[worker_id], state=rng.choice(list(WorkerState)))
            else:
                fleet[worker_id] = worker(index, rng)
            changed.add(worker_id)
        table.apply(fleet, changed if named else None)
        assert table_resources(table) == built_resources(fleet)


def test_a_named_change_builds_only_its_pools() -> None:
    """One worker's change rebuilds its pool's cluster (two when it moved), never the others."""
    fleet = {f"w{i}": WorkerRecord(id=f"w{i}", pool=POOLS[i % 3].name, model="m", host=f"10.0.0.{i + 1}", port=8000)
             for i in range(30)}
    server = XdsServer(POOLS, fallback_period_s=3600.0)
    server.update(fleet)
    built = server.assignments_built
    fleet["w0"] = replace(fleet["w0"], state=WorkerState.DRAINING)
    server.update(fleet, {"w0"})
    assert server.assignments_built == built + 1
    fleet["w1"] = replace(fleet["w1"], pool="long")
    server.update(fleet, {"w1"})
    assert server.assignments_built == built + 3
    snapshot = server._cache.get(ENDPOINT_TYPE_URL)
    assert snapshot is not None
    shard = worker_cluster("long", "w1", 3)
    hosts = {name: {e.endpoint.hostname for e in snapshot.resources[name].endpoints[0].lb_endpoints}  # type: ignore[attr-defined]
             for name in (cluster_name("code"), shard)}
    assert "w1" in hosts[shard] and "w1" not in hosts[cluster_name("code")]
    server.update(fleet, {"w7"})  # named, but nothing Envoy sees of it changed
    assert server.assignments_built == built + 3
    assert FALLBACK_CLUSTER in snapshot.resources


def hostnames(assignment: object) -> set[str]:
    return {e.endpoint.hostname for locality in assignment.endpoints  # type: ignore[attr-defined]
            for e in locality.lb_endpoints}


def test_a_sharded_pool_sends_one_shard_per_change() -> None:
    """A pool of 1,000 in 10 shards: each shard's cluster holds the workers ``worker_cluster`` names for it
    (extproc names the same), 60-140 each; a worker's change rebuilds its shard alone, and the fallback still
    holds every worker."""
    big = PoolSpec(name="big", model="m", endpoint_shards=10)
    fleet = {f"w{i:04d}": WorkerRecord(id=f"w{i:04d}", pool="big", model="m", host=f"10.1.{i // 250}.{i % 250 + 1}",
                                       port=8000) for i in range(1000)}
    server = XdsServer((big,), fallback_period_s=3600.0)
    server.update(fleet)
    snapshot = server._cache.get(ENDPOINT_TYPE_URL)
    assert snapshot is not None
    clusters = pool_clusters("big", 10)
    members = {cluster: hostnames(snapshot.resources[cluster]) for cluster in clusters}
    for cluster in clusters:
        assert members[cluster] == {w for w in fleet if worker_cluster("big", w, 10) == cluster}
        assert 60 <= len(members[cluster]) <= 140, (cluster, len(members[cluster]))
    assert hostnames(snapshot.resources[FALLBACK_CLUSTER]) == set(fleet)
    built = server.assignments_built
    fleet["w0007"] = replace(fleet["w0007"], state=WorkerState.DRAINING)
    server.update(fleet, {"w0007"})
    assert server.assignments_built == built + 1
    changed = server._cache.get(ENDPOINT_TYPE_URL)
    assert changed is not None
    moved = {name for name in clusters if changed.versions[name] != snapshot.versions[name]}
    assert moved == {worker_cluster("big", "w0007", 10)}


def test_a_cluster_past_the_large_size_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    """An operator whose single-cluster pool grew past 2,000 workers is told, once, how many shards to set."""
    fleet = {f"w{i:04d}": WorkerRecord(id=f"w{i:04d}", pool="chat", model="m", host=f"10.1.{i // 250}.{i % 250 + 1}",
                                       port=8000) for i in range(2001)}
    server = XdsServer(POOLS, fallback_period_s=3600.0)
    with caplog.at_level("WARNING", logger="controller.xds.server"):
        server.update(fleet)
        fleet["w0001"] = replace(fleet["w0001"], state=WorkerState.DRAINING)
        server.update(fleet, {"w0001"})
    warnings = [r.getMessage() for r in caplog.records if "endpoint_shards" in r.getMessage()]
    assert len(warnings) == 1
    assert "pool-chat holds 2001 endpoints" in warnings[0] and "about 3" in warnings[0]
