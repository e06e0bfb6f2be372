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
from poolgate.kernel.routing import FALLBACK_CLUSTER, cluster_name

POOLS = tuple(PoolSpec(name=name, model="m") for name in ("chat", "code", "long"))


def worker(index: int, rng: random.Random) -> WorkerRecord:
    return WorkerRecord(id=f"w{index:03d}", pool=rng.choice([*(p.name for p in POOLS), "gone-pool"]), model="m",
                        host=rng.choice(["10.0.0.1", "10.0.0.2", "::1", "not-an-ip"]),
                        port=rng.choice([8000, 8001, 8002, 0]), state=rng.choice(list(WorkerState)))


def table_resources(table: EndpointTable) -> list[bytes]:
    return [a.SerializeToString(deterministic=True)
            for a in [*(table.assignment(p.name) for p in POOLS), table.fallback()]]


def built_resources(fleet: dict[str, WorkerRecord]) -> list[bytes]:
    return [a.SerializeToString(deterministic=True) for a in build_endpoints(POOLS, list(fleet.values()))]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("named", [True, False], ids=["delta", "whole"])
def test_changes_applied_one_by_one_match_a_build_of_the_whole_fleet(seed: int, named: bool) -> None:
    """Joins, leaves, state, address and pool changes, duplicate addresses and unusable workers, applied as
    deltas (the ids named) or as whole fleets: after every step each pool's and the fallback's assignment
    equals the one built from scratch."""
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
    """One worker's change rebuilds its pool (two when it moved), never the others."""
    fleet = {f"w{i}": WorkerRecord(id=f"w{i}", pool=POOLS[i % 3].name, model="m", host=f"10.0.0.{i + 1}", port=8000)
             for i in range(30)}
    server = XdsServer(POOLS, fallback_period_s=3600.0)
    server.update(fleet)
    built = server.pools_built
    fleet["w0"] = replace(fleet["w0"], state=WorkerState.DRAINING)
    server.update(fleet, {"w0"})
    assert server.pools_built == built + 1
    fleet["w1"] = replace(fleet["w1"], pool="long")
    server.update(fleet, {"w1"})
    assert server.pools_built == built + 3
    snapshot = server._cache.get(ENDPOINT_TYPE_URL)
    assert snapshot is not None
    hosts = {name: {e.endpoint.hostname for e in snapshot.resources[name].endpoints[0].lb_endpoints}  # type: ignore[attr-defined]
             for name in (cluster_name("code"), cluster_name("long"))}
    assert "w1" in hosts[cluster_name("long")] and "w1" not in hosts[cluster_name("code")]
    server.update(fleet, {"w7"})  # named, but nothing Envoy sees of it changed
    assert server.pools_built == built + 3
    assert FALLBACK_CLUSTER in snapshot.resources
